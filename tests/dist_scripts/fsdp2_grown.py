"""Two-process FSDP2 jobs on a grown tiny Llama, launched by tests/test_distributed.py under torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_scripts/fsdp2_grown.py \
        --root OUT --jobs '[{"kind": "direct"}, {"kind": "fsdp", "name": "straight"}]'

Jobs run in order in one process group (one launch pays the imports once):

- `direct`: FSDP2 driven by hand (`hf_depthgrow.training.sharding.shard_grown_model`), AdamW on the
  new block only; every rank writes `direct_rank{r}.pt` (step losses, gathered full state dict).
- `fsdp`: `GrownTrainer` under accelerate's FSDP2 path (`sharding.fsdp2_accelerator`), writing
  `<root>/<name>/` like any run (checkpoints, `model/`, `train_result.json`). `abandon_after_step: n`
  drops the run after step n (no final save); `stop_after_step` hard-exits both ranks (code 17), so
  such a job must come last.
- `ddp`: the same under accelerate's DDP on gloo; must come before any `fsdp` job (accelerate's
  state is one per process, and `fsdp2_accelerator` switches it to FSDP).
- `sharded`: the base sharded first (`shard_grown_model` on the ungrown model), then `grow_depth`;
  rank 0 writes `<root>/sharded.json`: the error and the layer count after the call.

The test imports `grown_model`, `lm_rows`, `direct_batches` and `trainer_config` from here to build
the single-process reference from the very same model, data and settings.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

SEED, GLOBAL_BATCH, DIRECT_STEPS, LR = 0, 4, 6, 3e-3


def pretrain_base(path: Path, steps: int = 40) -> None:
    """The tiny Llama of the brief, seeded, trained in full on rows like the test data, saved to `path`.

    A base that already fits the data is what growth starts from in practice, and what makes the
    fallback rule's choice non-trivial (an overshooting run can then end worse than the base).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=100)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = lm_rows(256, seed=0)
    for s in range(steps):
        chunk = [rows[(s * 16 + i) % len(rows)] for i in range(16)]
        loss_sum, count = token_loss_sum(model, {k: torch.stack([r[k] for r in chunk]) for k in chunk[0]})
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.save_pretrained(path)


def grown_model(base: Path):
    """The pretrained base from `base`, grown by one native block at k = 2 (a copy of layer 1, residual outputs zeroed)."""
    from transformers import LlamaForCausalLM

    from hf_depthgrow import grow_depth

    return grow_depth(LlamaForCausalLM.from_pretrained(base).eval(), [2])


def lm_rows(n: int, seq: int = 16, seed: int = 1) -> list[dict]:
    """Learnable rows: arithmetic sequences mod 100 (random start, step 1..3), so the loss falls within a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 100, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + step * torch.arange(seq)) % 100
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def direct_batches() -> list[dict]:
    """`DIRECT_STEPS` global batches of `GLOBAL_BATCH` rows, as stacked tensors."""
    rows = lm_rows(DIRECT_STEPS * GLOBAL_BATCH, seed=2)
    batches = []
    for s in range(DIRECT_STEPS):
        chunk = rows[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]
        batches.append({k: torch.stack([r[k] for r in chunk]) for k in chunk[0]})
    return batches


def token_loss_sum(model, batch: dict) -> tuple[torch.Tensor, int]:
    """Sum of next-token losses over the batch and the number of predicted tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    pred, target = logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(pred.float(), target, reduction="sum"), target.numel()


def direct_step(model, optimizer, batch: dict, rank: int, world: int) -> float:
    """One AdamW step on this rank's slice of a global batch; the gradient is that of the global token mean.

    FSDP2 averages gradients over processes (reduce-scatter), hence the `* world`; with `world=1`
    this is the plain single-process step the test compares against.
    """
    per = batch["input_ids"].shape[0] // world
    local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
    total_tokens = batch["labels"][:, 1:].numel()
    loss_sum, _ = token_loss_sum(model, local)
    (loss_sum / total_tokens * world).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    summed = loss_sum.detach().double()
    if world > 1:
        torch.distributed.all_reduce(summed)
    return float(summed / total_tokens)


def freeze_all_but_new(model) -> list:
    """`requires_grad` only on the new block; returns its parameters (what AdamW gets)."""
    from hf_depthgrow import new_block_parameters

    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for _, p in new_block_parameters(model)]
    for p in params:
        p.requires_grad_(True)
    return params


def run_direct(root: Path, base: Path, rank: int, world: int) -> None:
    from hf_depthgrow.training.sharding import full_state_dict, is_sharded, shard_grown_model

    model = grown_model(base)
    freeze_all_but_new(model)
    shard_grown_model(model)
    assert is_sharded(model)
    # Built after sharding: the optimizer must hold the DTensor shards, not the replaced full tensors.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = [direct_step(model, optimizer, batch, rank, world) for batch in direct_batches()]
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    state = full_state_dict(model)  # collective: every rank gets the full tensors
    torch.save({"losses": losses, "state": state, "local_numel": local_numel}, root / f"direct_rank{rank}.pt")


def run_sharded_then_grown(root: Path, base: Path, rank: int) -> None:
    from transformers import LlamaForCausalLM

    from hf_depthgrow import grow_depth
    from hf_depthgrow.training.sharding import shard_grown_model

    model = shard_grown_model(LlamaForCausalLM.from_pretrained(base))
    error = None
    try:
        grow_depth(model, [2])
    except ValueError as err:
        error = str(err)
    if rank == 0:
        (root / "sharded.json").write_text(json.dumps({"error": error, "layers": len(model.model.layers)}))


def trainer_config(**overrides):
    """The `TrainConfig` of the trainer jobs; `per_device_train_batch_size` makes the global batch 4 for any process count."""
    from hf_depthgrow.training import TrainConfig

    world = overrides.pop("world", 2)
    defaults = dict(max_steps=6, per_device_train_batch_size=GLOBAL_BATCH // world, learning_rate=LR, logging_steps=1,
                progress_bar=False, fallback=True, seed=5, eval_steps=0)
    return TrainConfig(**{**defaults, **overrides})


def trainer_data() -> tuple[list[dict], list[dict]]:
    rows = lm_rows(32, seed=3)
    return rows[:24], rows[24:]


def ddp_accelerator():
    """accelerate's DDP on CPU processes (gloo), what `accelerate launch` with `ACCELERATE_USE_CPU=true` gives."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    return Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=120))])


def run_trainer(root: Path, base: Path, job: dict) -> None:
    """A `train()` run under FSDP2 (`kind: fsdp`) or DDP (`kind: ddp`, only before any FSDP job: accelerate's state is per process)."""
    from hf_depthgrow.training import GrownTrainer
    from hf_depthgrow.training.sharding import fsdp2_accelerator

    settings = {k: v for k, v in job.items() if k not in ("kind", "name", "abandon_after_step")}
    config = trainer_config(output_dir=str(root / job["name"]), **settings)
    train_rows, held_out = trainer_data()
    accelerator = fsdp2_accelerator(timeout_s=120) if job["kind"] == "fsdp" else ddp_accelerator()
    trainer = GrownTrainer(grown_model(base), config, train_rows, held_out, accelerator=accelerator)
    train_or_abandon(trainer, job)


def train_or_abandon(trainer, job: dict) -> None:
    """Train to the end, or (`abandon_after_step`) give the run up after that step: no final save, no
    selection; what it did after its last checkpoint is lost, and a resuming job starts from a fresh
    model and the checkpoint alone."""
    if "abandon_after_step" not in job:
        trainer.train()
        return
    trainer.begin()
    trainer.run_steps(job["abandon_after_step"])
    trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--base", required=True, help="the folder pretrain_base wrote")
    parser.add_argument("--jobs", required=True, help="JSON list of job dicts")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"[rank {os.environ['RANK']}] imports: {time.process_time():.1f} CPU s", flush=True)
    root, base = Path(args.root), Path(args.base)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")  # accelerate joins this group instead of making its own
    try:
        for job in json.loads(args.jobs):
            cpu = time.process_time()
            if job["kind"] == "direct":
                run_direct(root, base, rank, world)
            elif job["kind"] == "sharded":
                run_sharded_then_grown(root, base, rank)
            else:
                run_trainer(root, base, job)
            torch.distributed.barrier()
            # Process CPU time per job (the wall clock says little on a shared machine).
            print(f"[rank {rank}] job {job.get('name', job['kind'])}: {time.process_time() - cpu:.1f} CPU s", flush=True)
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
