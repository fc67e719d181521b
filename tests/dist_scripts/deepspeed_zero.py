"""DeepSpeed ZeRO-2 / ZeRO-3 on CPU processes with a frozen base and a trainable new block (tests/test_distributed.py).

    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/dist_scripts/deepspeed_zero.py --base BASE --out OUT --stages 2 3

DeepSpeed is driven directly (`deepspeed.initialize`), without GrownTrainer (whose DeepSpeed runs are
deepspeed_grown.py's `trainer` jobs; the test runs `train_zero` from there, as its `direct` jobs, to
share one launch). Same model, data, loss and AdamW settings as the FSDP2 `direct` job of
fsdp2_grown.py; rank 0 writes `<out>/zero{stage}.pt` (losses, full weights) for each stage, one after
the other in one process group.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fsdp2_grown import GLOBAL_BATCH, LR, direct_batches, freeze_all_but_new, grown_model, token_loss_sum  # noqa: E402


def ds_config(stage: int, world: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        # The client torch AdamW (DeepSpeed's own CPU Adam would be JIT-compiled with a C++ toolchain).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def full_weights(engine, stage: int) -> dict[str, torch.Tensor]:
    """Full copies of every parameter; under ZeRO-3 gathered from the partitions (a collective)."""
    model = engine.module
    if stage == 3:
        import deepspeed

        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_zero(base: Path, stage: int, rank: int, world: int) -> dict:
    """`DIRECT_STEPS` AdamW steps of the new block under ZeRO-`stage`; returns the step losses and full weights."""
    import deepspeed

    model = grown_model(base)
    trainable = freeze_all_but_new(model)
    optimizer = torch.optim.AdamW(trainable, lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=trainable, config=ds_config(stage, world))
    losses, per = [], GLOBAL_BATCH // world
    for batch in direct_batches():
        local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
        loss_sum, _ = token_loss_sum(engine, local)
        total = batch["labels"][:, 1:].numel()
        # DeepSpeed averages gradients over processes, as DDP does: the gradient of the global mean.
        engine.backward(loss_sum / total * world)
        engine.step()
        summed = loss_sum.detach().double()
        torch.distributed.all_reduce(summed)
        losses.append(float(summed / total))
    return {"losses": losses, "state": full_weights(engine, stage)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", type=int, nargs="+", choices=(2, 3), default=[2, 3])
    args = parser.parse_args()
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.ops

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (a C++ build of minutes on first
    # use, cached in ~/.cache/torch_extensions); it only speeds up collectives, so use plain gloo.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        for stage in args.stages:
            result = train_zero(Path(args.base), stage, rank, world)
            if rank == 0:
                torch.save(result, Path(args.out) / f"zero{stage}.pt")
            torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
