"""Sharded training of grown models on two CPU processes (gloo): FSDP2 by hand and under GrownTrainer, DeepSpeed ZeRO.

The model is the brief's tiny Llama (hidden 64, 4 layers, 4 heads, 2 KV heads, vocab 100), trained
briefly in full first (`pretrain_base`, so that a bad run can end worse than the base), then grown
by one native block at k = 2; only the new block trains. Every claim is checked against a
single-process run on the same data in this process:

- FSDP2 by hand (`sharding.shard_grown_model`): both ranks gather the same weights, each held half
  of them, the base is bit-identical, the loss fell, and the weights equal one process's;
- GrownTrainer on accelerate's FSDP2 path (`sharding.fsdp2_accelerator`): the same weights and
  losses as one process; a run abandoned after step 3 and resumed from checkpoint-2 (sharded,
  `torch.distributed.checkpoint`) in a new launch ends bit-identical to the uninterrupted run, and
  its checkpoints hold the frozen base bit-identical to the original; the fallback rule
  returns the original function when training made the losses worse, under FSDP2 and DDP;
- DeepSpeed ZeRO-2 and ZeRO-3 driven by hand, and GrownTrainer under both with the environment
  `accelerate launch --config_file recipes/accelerate_configs/deepspeed/zero{2,3}.yaml` gives:
  the same weights, losses and clipped gradient norms as one process (with gradient accumulation),
  bit-identical resume, the fallback rule, a complete saved model (skipped without `deepspeed`);
  the refusals of unsupported DeepSpeed settings run without it.

Launches go through `torchrun --standalone` (a free port each time) with a timeout; on a timeout
the launcher and its workers (which run in sessions of their own) are ended by pid. The scripts
live in tests/dist_scripts/ and share their model, data and settings with the references here.
2-process DDP under `accelerate launch` is tests/test_trainer.py::test_two_processes_match_one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"


def _fsdp2_available() -> bool:
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        return False
    from torch.distributed import fsdp

    return hasattr(fsdp, "fully_shard")  # public since torch 2.6


# Launching tests: slow (a few tens of CPU seconds per launch) and in need of gloo and FSDP2.
needs_processes = pytest.mark.skipif(not _fsdp2_available(), reason="needs torch.distributed with gloo and fully_shard (torch >= 2.6)")


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"dist_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


F = _load_script("fsdp2_grown")


def launch(script: str, args: list[str], *, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node 2 script args`; on a timeout, end the launcher and its workers, then fail."""
    import psutil

    full_env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPTS / script), *args]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        workers = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers and waits for them
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        for worker in workers:  # workers run in sessions of their own: a killed launcher leaves them behind
            if worker.is_running():
                worker.kill()
        pytest.fail(f"{script} did not finish within {timeout} s:\n{out[-2000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def tail(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout[-2000:] + proc.stderr[-5000:]


def new_names(model) -> set[str]:
    from hf_depthgrow import new_block_parameters

    return {n for n, _ in new_block_parameters(model)}


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def saved_weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "model" / "model.safetensors"))


def mean_loss(model, batches) -> float:
    with torch.no_grad():
        sums = [F.token_loss_sum(model, b) for b in batches]
    return sum(float(s) for s, _ in sums) / sum(n for _, n in sums)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("base")
    F.pretrain_base(path)
    return path


@pytest.fixture(scope="module")
def fsdp_runs(base, tmp_path_factory) -> Path:
    """One launch, seven jobs: DDP with a ruinous learning rate; FSDP2 by hand; GrownTrainer on FSDP2 straight,
    with a ruinous learning rate, abandoned after step 3 (checkpoint-2 on disk; `fsdp_resumed` resumes it), and
    with gradient checkpointing; last, the base sharded first and grown afterwards."""
    root = tmp_path_factory.mktemp("fsdp2")
    jobs = [
        {"kind": "ddp", "name": "ddp_fallback", "learning_rate": 0.1},  # DDP first: fsdp jobs switch accelerate to FSDP
        {"kind": "direct"},
        {"kind": "fsdp", "name": "straight", "save_steps": 2},
        {"kind": "fsdp", "name": "fallback", "learning_rate": 0.1},
        {"kind": "fsdp", "name": "resumed", "save_steps": 2, "abandon_after_step": 3},
        {"kind": "fsdp", "name": "checkpointed", "save_steps": 2, "gradient_checkpointing": True},
        {"kind": "sharded"},
    ]
    proc = launch("fsdp2_grown.py", ["--root", str(root), "--base", str(base), "--jobs", json.dumps(jobs)], timeout=300)
    assert proc.returncode == 0, tail(proc)
    return root


@pytest.fixture(scope="module")
def fsdp_resumed(fsdp_runs, base) -> Path:
    """A second launch (new processes, fresh models from the base) resuming `fsdp_runs`' abandoned run from its checkpoint-2."""
    job = {"kind": "fsdp", "name": "resumed", "save_steps": 2, "resume_from_checkpoint": "latest"}
    assert [p.name for p in (fsdp_runs / "resumed").glob("checkpoint-*")] == ["checkpoint-2"]
    proc = launch("fsdp2_grown.py", ["--root", str(fsdp_runs), "--base", str(base), "--jobs", json.dumps([job])], timeout=180)
    assert proc.returncode == 0, tail(proc)
    return fsdp_runs / "resumed"


@pytest.mark.slow
@needs_processes
def test_fsdp2_by_hand_matches_one_process(fsdp_runs, base):
    """Tolerance: max |w_fsdp - w_1proc| <= 5e-5, under 2% of one AdamW step at lr 3e-3 (measured 3.0e-6;
    docs/integrations/distributed.md). Only the gradient's summation order differs (reduce-scatter of
    two halves); AdamW divides by the root of the second moment, which magnifies relative differences
    of tiny gradient entries."""
    from hf_depthgrow.training.sharding import load_full_state_dict

    ranks = [torch.load(fsdp_runs / f"direct_rank{r}.pt", weights_only=True) for r in (0, 1)]
    start = F.grown_model(base)
    initial, new = weights(start), new_names(start)
    state = ranks[0]["state"]
    assert state.keys() == initial.keys()
    for name in state:  # gathered on each rank: the same full weights on both
        assert torch.equal(state[name], ranks[1]["state"][name]), name
    total = sum(t.numel() for t in state.values())
    assert ranks[0]["local_numel"] < total and ranks[0]["local_numel"] + ranks[1]["local_numel"] >= total  # really sharded
    for name in initial.keys() - new:
        assert torch.equal(state[name], initial[name]), name  # frozen base: bit-identical
    for name in ("model.layers.2.self_attn.o_proj.weight", "model.layers.2.mlp.down_proj.weight"):
        assert not torch.equal(state[name], initial[name]), name  # the zero-initialised outputs trained

    reference = F.grown_model(base)  # the same steps in one process
    optimizer = torch.optim.AdamW(F.freeze_all_but_new(reference), lr=F.LR)
    losses = [F.direct_step(reference, optimizer, batch, 0, 1) for batch in F.direct_batches()]
    assert ranks[0]["losses"] == pytest.approx(losses, rel=1e-6)
    worst = max((state[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    assert worst <= 5e-5, worst
    # The trained weights lower the loss over all the batches they were trained on.
    load_full_state_dict(start, state)
    assert mean_loss(start, F.direct_batches()) < mean_loss(F.grown_model(base), F.direct_batches()) - 0.05  # 1.541 -> 1.438


@pytest.mark.slow
@needs_processes
def test_grown_trainer_under_fsdp2_matches_one_process(fsdp_runs, base):
    from hf_depthgrow.training import train

    run = fsdp_runs / "straight"
    result = json.loads((run / "train_result.json").read_text())
    assert result["num_processes"] == 2 and result["prefix_cache"] is None  # prefix_cache="auto" is off when sharded
    assert result["selected"] == "new" and result["train_losses"]["new"] < result["train_losses"]["old"]
    assert result["eval_loss_after"] < result["eval_loss_before"]
    shards = sorted(p.name for p in (run / "checkpoint-6" / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # one shard file per process

    start = F.grown_model(base)
    initial, new = weights(start), new_names(start)
    got = saved_weights(run)
    for name in initial.keys() - new:
        assert torch.equal(got[name], initial[name]), name
    train_rows, held_out = F.trainer_data()
    one = train(F.grown_model(base), train_rows, eval_data=held_out, config=F.trainer_config(world=1))
    reference = weights(one.model)
    worst = max((got[n] - reference[n]).abs().max().item() for n in new)
    assert worst <= 5e-5, worst
    assert [h["loss"] for h in result["history"]] == pytest.approx([h["loss"] for h in one.history], rel=1e-5)
    assert result["train_losses"]["new"] == pytest.approx(one.train_losses["new"], rel=1e-5)


@pytest.mark.slow
@needs_processes
def test_gradient_checkpointing_under_fsdp2_gives_the_same_weights(fsdp_runs):
    """The layers recomputed in backward inside FSDP2's sharded modules: the same training as without it."""
    a, b = saved_weights(fsdp_runs / "checkpointed"), saved_weights(fsdp_runs / "straight")
    assert a.keys() == b.keys()
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    assert worst <= 1e-6, worst
    checkpointed = json.loads((fsdp_runs / "checkpointed" / "train_result.json").read_text())
    straight = json.loads((fsdp_runs / "straight" / "train_result.json").read_text())
    assert [h["loss"] for h in checkpointed["history"]] == pytest.approx([h["loss"] for h in straight["history"]], rel=1e-6)


def assert_resumed_equals_straight(resumed_dir, straight_dir) -> None:
    """A run resumed from checkpoint-2 ended bit-identical to the uninterrupted one: same shards, same order of operations."""
    resumed = json.loads((resumed_dir / "train_result.json").read_text())
    straight = json.loads((straight_dir / "train_result.json").read_text())
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["global_step"] == 6
    a, b = saved_weights(resumed_dir), saved_weights(straight_dir)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in straight["history"]]
    assert resumed["train_losses"] == straight["train_losses"] and resumed["selected"] == straight["selected"]


@pytest.mark.slow
@needs_processes
def test_fsdp2_resume_gives_the_same_weights(fsdp_resumed, fsdp_runs):
    """Abandoned after step 3 with checkpoint-2 (sharded) on disk, resumed in a new launch on a fresh model:
    the uninterrupted result, bit for bit."""
    assert_resumed_equals_straight(fsdp_resumed, fsdp_runs / "straight")


def sharded_model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The full tensors of an FSDP checkpoint's `pytorch_model_fsdp_0` (torch.distributed.checkpoint), read in this one process."""
    import warnings

    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder / "pytorch_model_fsdp_0"))
    meta = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, no group: as intended
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {k.removeprefix("model."): v for k, v in state.items()}  # accelerate saves the model's state dict under "model"


@pytest.mark.slow
@needs_processes
def test_fsdp2_checkpoints_hold_the_frozen_base(fsdp_resumed, fsdp_runs, base):
    """An FSDP checkpoint holds every weight, the frozen base bit-identical to the original's (so a resume
    restores it from the checkpoint), and the run resumed in a new launch wrote the same checkpoint-6."""
    initial = weights(F.grown_model(base))
    new = new_names(F.grown_model(base))
    straight, resumed = sharded_model_state(fsdp_runs / "straight" / "checkpoint-6"), sharded_model_state(fsdp_resumed / "checkpoint-6")
    assert straight.keys() == resumed.keys() == initial.keys()
    for name in initial.keys() - new:
        assert torch.equal(straight[name], initial[name]) and torch.equal(resumed[name], initial[name]), name
    final = saved_weights(fsdp_runs / "straight")  # selected "new": the weights after step 6
    for name in new:
        assert not torch.equal(straight[name], initial[name]), name
        assert torch.equal(straight[name], final[name]) and torch.equal(resumed[name], final[name]), name


@pytest.mark.slow
@needs_processes
def test_growing_an_fsdp_sharded_model_is_refused(fsdp_runs):
    got = json.loads((fsdp_runs / "sharded.json").read_text())
    assert got["error"] is not None and "FSDP shard" in got["error"] and "\n" not in got["error"]
    assert got["layers"] == 4  # refused before the model was touched


@pytest.mark.slow
@needs_processes
@pytest.mark.parametrize("name", ["fallback", "ddp_fallback"], ids=["fsdp2", "ddp"])
def test_fallback_returns_the_original_when_training_hurt(fsdp_runs, base, name):
    """lr 0.1 on a base that already fits the data: training and held-out losses both rise; f_old is returned."""
    from transformers import LlamaForCausalLM

    run = fsdp_runs / name
    result = json.loads((run / "train_result.json").read_text())
    assert result["num_processes"] == 2
    assert result["train_losses"]["new"] > result["train_losses"]["old"]
    assert result["eval_loss_after"] > result["eval_loss_before"]  # training made held-out loss worse
    assert result["selected"] == "old" and result["eval_loss_selected"] == result["eval_loss_before"]
    got, initial = saved_weights(run), weights(F.grown_model(base))
    assert got.keys() == initial.keys()
    for name in got:  # the new block is back at its zero-initialised start: the grown model is f_old
        assert torch.equal(got[name], initial[name]), name
    saved = LlamaForCausalLM.from_pretrained(run / "model").eval()
    original = LlamaForCausalLM.from_pretrained(base).eval()
    ids = torch.stack([r["input_ids"] for r in F.trainer_data()[1]])
    with torch.no_grad():
        torch.testing.assert_close(saved(input_ids=ids).logits, original(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


DS_CLIP = 0.15  # below the gradient norms of steps 1-4 (0.16-0.23), above those of steps 5-6: clipping acts and rests


def accelerate_launch_env(yaml_name: str, **overrides: str) -> dict[str, str]:
    """The `ACCELERATE_*` variables `accelerate launch --config_file deepspeed/<yaml_name> --mixed_precision no` gives its processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    path = REPO / "recipes" / "accelerate_configs" / "deepspeed" / yaml_name
    args, defaults, mp_from_config = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(path), "--mixed_precision", "no", "x.py"])
    )
    # What `launch_command` sets before calling the DeepSpeed launcher.
    args.deepspeed_fields_from_accelerate_config = ",".join([*defaults.deepspeed_config, *(["mixed_precision"] if mp_from_config else [])])
    _, env = prepare_deepspeed_cmd_env(args)
    return {**{k: v for k, v in env.items() if k.startswith("ACCELERATE_")}, **overrides}


@pytest.fixture(scope="module")
def deepspeed_runs(base, tmp_path_factory) -> Path:
    """One launch: for ZeRO-2 then ZeRO-3, DeepSpeed by hand, then GrownTrainer straight (2 micro-batches of 1 per
    process, clipping at DS_CLIP), abandoned after step 3 (checkpoint-2 on disk) and, under ZeRO-2, resumed from
    it in the same launch, with a ruinous learning rate, and with gradient checkpointing; last, a run whose
    DeepSpeed config disagrees with its TrainConfig, and growth of a model loaded under zero.Init."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("deepspeed")
    accum = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 1, "max_grad_norm": DS_CLIP}
    jobs = []
    for stage in (2, 3):
        env = accelerate_launch_env(f"zero{stage}.yaml", ACCELERATE_GRADIENT_ACCUMULATION_STEPS="2", ACCELERATE_GRADIENT_CLIPPING=str(DS_CLIP))
        jobs += [
            {"kind": "direct", "stage": stage},
            {"kind": "trainer", "name": f"zero{stage}_straight", "env": env, "save_steps": 2, **accum},
            {"kind": "trainer", "name": f"zero{stage}_resumed", "env": env, "save_steps": 2, "abandon_after_step": 3, **accum},
            *([{"kind": "trainer", "name": "zero2_resumed", "env": env, "save_steps": 2, "resume_from_checkpoint": "latest", **accum}]
              if stage == 2 else []),  # ZeRO-3's resume is a launch of its own: `zero3_resumed`
            {"kind": "trainer", "name": f"zero{stage}_fallback", "env": accelerate_launch_env(f"zero{stage}.yaml"), "learning_rate": 0.1},
            {"kind": "trainer", "name": f"zero{stage}_checkpointed", "env": env, "save_steps": 2, "gradient_checkpointing": True, **accum},
        ]
    # zero2.yaml as shipped says gradient_accumulation_steps: 1.
    jobs.append({"kind": "refused", "name": "refused_accumulation", "env": accelerate_launch_env("zero2.yaml"),
                 "gradient_accumulation_steps": 2, "per_device_train_batch_size": 1})
    jobs.append({"kind": "partitioned", "name": "partitioned"})
    proc = launch("deepspeed_grown.py", ["--root", str(root), "--base", str(base), "--jobs", json.dumps(jobs)],
                  timeout=420, env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, tail(proc)
    return root


@pytest.fixture(scope="module")
def zero3_resumed(deepspeed_runs, base) -> Path:
    """A second launch (new processes, fresh models from the base: the frozen weights come from nowhere else, since the
    engine's checkpoint leaves them out) resuming the ZeRO-3 run abandoned after step 3 from its checkpoint-2."""
    accum = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 1, "max_grad_norm": DS_CLIP}
    env = accelerate_launch_env("zero3.yaml", ACCELERATE_GRADIENT_ACCUMULATION_STEPS="2", ACCELERATE_GRADIENT_CLIPPING=str(DS_CLIP))
    job = {"kind": "trainer", "name": "zero3_resumed", "env": env, "save_steps": 2, "resume_from_checkpoint": "latest", **accum}
    assert [p.name for p in (deepspeed_runs / "zero3_resumed").glob("checkpoint-*")] == ["checkpoint-2"]
    proc = launch("deepspeed_grown.py", ["--root", str(deepspeed_runs), "--base", str(base), "--jobs", json.dumps([job])],
                  timeout=180, env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, tail(proc)
    return deepspeed_runs / "zero3_resumed"


@pytest.fixture(scope="module")
def one_process_clipped(base):
    """GrownTrainer in one process, global batch 4 in one micro-batch, clipped at DS_CLIP: `(result, weights)`."""
    from hf_depthgrow.training import train

    train_rows, held_out = F.trainer_data()
    one = train(F.grown_model(base), train_rows, eval_data=held_out, config=F.trainer_config(world=1, max_grad_norm=DS_CLIP))
    return one, weights(one.model)


@pytest.mark.slow
@needs_processes
def test_deepspeed_zero2_and_zero3_frozen_base(deepspeed_runs, base):
    """ZeRO-2 and ZeRO-3 (DeepSpeed on CPU, gloo, client torch AdamW) driven by hand train the new block as one process does."""
    start = F.grown_model(base)
    initial, new = weights(start), new_names(start)
    reference = F.grown_model(base)
    optimizer = torch.optim.AdamW(F.freeze_all_but_new(reference), lr=F.LR)
    losses = [F.direct_step(reference, optimizer, batch, 0, 1) for batch in F.direct_batches()]
    for stage in (2, 3):
        got = torch.load(deepspeed_runs / f"zero{stage}.pt", weights_only=True)
        state = got["state"]
        assert state.keys() == initial.keys(), stage
        for name in initial.keys() - new:
            assert torch.equal(state[name], initial[name]), (stage, name)  # frozen base untouched (and gathered whole under ZeRO-3)
        assert got["losses"] == pytest.approx(losses, rel=1e-5), stage
        worst = max((state[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
        assert worst <= 5e-5, (stage, worst)


@pytest.mark.slow
@needs_processes
@pytest.mark.parametrize("stage", [2, 3])
def test_grown_trainer_under_deepspeed_matches_one_process(deepspeed_runs, one_process_clipped, base, stage):
    """Two processes x 2 micro-batches of 1 (accumulated, clipped by the engine) vs one process x 1 micro-batch of 4.

    Tolerances as for FSDP2: weights 5e-5 (measured 8.1e-7 under ZeRO-2, 1.2e-6 under ZeRO-3), losses and
    gradient norms 1e-5 relative (measured at most 3e-7). Only the gradient's summation order differs.
    Clipping at DS_CLIP moves the weights by 1.4e-3 against an unclipped run, and a gradient not
    accumulated (or scaled by the engine's 1/accumulation) changes the norms and the clipping: the
    weight tolerance separates both from a match.
    """
    from hf_depthgrow import load_pretrained

    one, reference = one_process_clipped
    run = deepspeed_runs / f"zero{stage}_straight"
    result = json.loads((run / "train_result.json").read_text())
    assert result["num_processes"] == 2 and result["prefix_cache"] is None
    assert result["num_trainable_parameters"] == one.num_trainable_parameters == 36_992  # counted before ZeRO-3 partitions
    assert result["selected"] == "new" and result["train_losses"]["new"] < result["train_losses"]["old"]
    assert result["eval_loss_after"] < result["eval_loss_before"]
    assert (run / "checkpoint-6" / "pytorch_model").is_dir()  # the engine's checkpoint, through accelerate's save_state

    start = F.grown_model(base)
    initial, new = weights(start), new_names(start)
    got = saved_weights(run)
    assert got.keys() == initial.keys()  # the saved model is complete, frozen base included
    for name in initial.keys() - new:
        assert torch.equal(got[name], initial[name]), name  # frozen base: bit-identical
    for name in new:
        assert not torch.equal(got[name], initial[name]), name  # every tensor of the new block trained
    worst = max((got[n] - reference[n]).abs().max().item() for n in new)
    assert worst <= 5e-5, worst
    history = result["history"]
    assert [h["loss"] for h in history] == pytest.approx([h["loss"] for h in one.history], rel=1e-5)
    assert [h["grad_norm"] for h in history] == pytest.approx([h["grad_norm"] for h in one.history], rel=1e-5)
    norms = [h["grad_norm"] for h in history]
    assert max(norms) > DS_CLIP > min(norms)  # clipping acted on some steps and not on others
    assert result["train_losses"]["new"] == pytest.approx(one.train_losses["new"], rel=1e-5)
    reloaded = load_pretrained(run / "model")
    for name, param in reloaded.named_parameters():
        assert torch.equal(param, got[name]), name


@pytest.mark.slow
@needs_processes
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_resume_gives_the_same_weights(deepspeed_runs, request, base, stage):
    """Abandoned after step 3 with checkpoint-2 (the engine's: trainable set, partitioned optimizer state) on disk,
    resumed on a fresh model (ZeRO-3: in a new launch): bit-identical to the uninterrupted run, frozen base included.
    Every checkpoint records the sampled hash of the base it relies on (a resume on another base is refused:
    tests/test_resume_frozen_base.py)."""
    from hf_depthgrow.training.guards import base_weights_fingerprint

    resumed = request.getfixturevalue("zero3_resumed") if stage == 3 else deepspeed_runs / "zero2_resumed"
    assert_resumed_equals_straight(resumed, deepspeed_runs / f"zero{stage}_straight")
    expected = base_weights_fingerprint(F.grown_model(base))
    for checkpoint in sorted(resumed.glob("checkpoint-*")):
        assert json.loads((checkpoint / "trainer_state.json").read_text())["fingerprint"]["base"] == expected, checkpoint


@pytest.mark.slow
@needs_processes
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_fallback_returns_the_original_when_training_hurt(deepspeed_runs, base, stage):
    """lr 0.1: losses rise, f_old is selected; under ZeRO-3 the new block is written back through GatheredParameters."""
    from transformers import LlamaForCausalLM

    from hf_depthgrow import load_pretrained

    run = deepspeed_runs / f"zero{stage}_fallback"
    result = json.loads((run / "train_result.json").read_text())
    assert result["train_losses"]["new"] > result["train_losses"]["old"]
    assert result["eval_loss_after"] > result["eval_loss_before"]
    assert result["selected"] == "old" and result["eval_loss_selected"] == result["eval_loss_before"]
    got, initial = saved_weights(run), weights(F.grown_model(base))
    assert got.keys() == initial.keys()
    for name in got:  # the new block is back at its zero-initialised start: the grown model is f_old
        assert torch.equal(got[name], initial[name]), name
    saved = load_pretrained(run / "model").eval()
    original = LlamaForCausalLM.from_pretrained(base).eval()
    ids = torch.stack([r["input_ids"] for r in F.trainer_data()[1]])
    with torch.no_grad():
        torch.testing.assert_close(saved(input_ids=ids).logits, original(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@needs_processes
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_checkpointing_under_deepspeed_gives_the_same_weights(deepspeed_runs, stage):
    """The layers recomputed in backward under the engine (ZeRO-3: re-gathering their partitions): the same training."""
    a, b = saved_weights(deepspeed_runs / f"zero{stage}_checkpointed"), saved_weights(deepspeed_runs / f"zero{stage}_straight")
    assert a.keys() == b.keys()
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    assert worst <= 1e-6, worst
    checkpointed = json.loads((deepspeed_runs / f"zero{stage}_checkpointed" / "train_result.json").read_text())
    straight = json.loads((deepspeed_runs / f"zero{stage}_straight" / "train_result.json").read_text())
    for key in ("loss", "grad_norm"):
        assert [h[key] for h in checkpointed["history"]] == pytest.approx([h[key] for h in straight["history"]], rel=1e-6), key


@pytest.mark.slow
@needs_processes
def test_deepspeed_mismatch_is_refused_before_any_work(deepspeed_runs):
    got = json.loads((deepspeed_runs / "refused_accumulation.json").read_text())
    assert got["error"].startswith("DeepSpeed gradient_accumulation_steps=1 but TrainConfig gives 2")
    assert "\n" not in got["error"] and not got["output_dir_created"]


@pytest.mark.slow
@needs_processes
def test_growing_a_zero3_partitioned_model_is_refused(deepspeed_runs):
    """Loaded under zero.Init every local weight is empty (shape [0]); a copy of it would be an empty new block."""
    got = json.loads((deepspeed_runs / "partitioned.json").read_text())
    assert got["local_shape"] == [0]  # really partitioned
    assert got["error"] is not None and "ZeRO-3 partitioned" in got["error"] and "zero3_init_flag: false" in got["error"]
    assert "\n" not in got["error"]
    assert got["layers"] == 4  # refused before the model was touched


# ----------------------------------------------------------------------------- configs and refusals (no processes)

ACCELERATE_CONFIGS = sorted((REPO / "recipes" / "accelerate_configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: str(p.relative_to(REPO / "recipes" / "accelerate_configs")))
def test_every_accelerate_config_loads_and_names_its_command(path):
    """Every shipped config, subfolders included (tests/test_recipes.py reads the top folder only)."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    config = ClusterConfig.from_yaml_file(str(path))  # accelerate's own loader: unknown keys raise
    name = str(path.relative_to(REPO / "recipes" / "accelerate_configs"))
    expected = {"single_gpu.yaml": DistributedType.NO, "multi_gpu.yaml": DistributedType.MULTI_GPU, "fsdp.yaml": DistributedType.FSDP,
                "deepspeed/zero2.yaml": DistributedType.DEEPSPEED, "deepspeed/zero3.yaml": DistributedType.DEEPSPEED}
    assert config.distributed_type == expected[name]
    assert f"accelerate launch --config_file {path.relative_to(REPO)}" in path.read_text()
    if config.distributed_type == DistributedType.DEEPSPEED:
        ds = config.deepspeed_config
        assert ds["zero_stage"] == int(name[-6])
        assert ds["zero3_init_flag"] is False  # the model is grown after loading: no partitioned placeholders at load
        assert ds["offload_param_device"] == ds["offload_optimizer_device"] == "none"
    if config.distributed_type == DistributedType.FSDP:
        assert config.fsdp_config["fsdp_version"] == 2  # per-parameter sharding: frozen and trainable may share a unit
        assert config.fsdp_config["fsdp_cpu_ram_efficient_loading"] is False


def test_fsdp_yaml_gives_the_plugin_the_cpu_tests_run(monkeypatch):
    """`accelerate launch --config_file fsdp.yaml` (GPUs) builds the same FSDP2 plugin as `sharding.fsdp2_plugin` (CPU tests)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    from hf_depthgrow.training.sharding import fsdp2_plugin

    args = launch_command_parser().parse_args(["--config_file", str(REPO / "recipes/accelerate_configs/fsdp.yaml"), "x.py"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])  # the environment the launched processes get
    for key, value in env.items():
        if key.startswith("FSDP_"):
            monkeypatch.setenv(key, value)
    from_yaml = FullyShardedDataParallelPlugin()  # reads FSDP_* like a launched process does
    for key in [k for k in os.environ if k.startswith("FSDP_")]:
        monkeypatch.delenv(key)
    ours = fsdp2_plugin()
    for field in ("fsdp_version", "reshard_after_forward", "state_dict_type", "auto_wrap_policy", "cpu_ram_efficient_loading",
                  "cpu_offload", "activation_checkpointing", "mixed_precision_policy", "transformer_cls_names_to_wrap"):
        assert getattr(from_yaml, field) == getattr(ours, field), field


@needs_processes
def test_shard_grown_model_refuses_adapter_blocks():
    from hf_depthgrow import grow_depth
    from hf_depthgrow.testing import tiny_model
    from hf_depthgrow.training.sharding import is_sharded, shard_grown_model

    model = grow_depth(tiny_model("llama"), [2], block="adapter")
    with pytest.raises(NotImplementedError, match="native blocks"):
        shard_grown_model(model)  # refused before any process group is needed
    assert not is_sharded(model)


def test_grow_depth_refuses_a_zero3_parameter_before_touching_the_model():
    """The refusal of the zero.Init launch above, without DeepSpeed or processes: one parameter carrying the
    attributes ZeRO-3's partitioning adds (`ds_id`; its local tensor would be empty) is enough."""
    from hf_depthgrow import grow_depth
    from hf_depthgrow.testing import tiny_model

    model = tiny_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.model.layers[3].mlp.up_proj.weight.ds_id = 7
    with pytest.raises(ValueError, match=r"^parameter `model.layers.3.mlp.up_proj.weight` is ZeRO-3 partitioned .*\(zero3_init_flag: false\)"):
        grow_depth(model, [2])
    assert len(model.model.layers) == 4 and model.config.num_hidden_layers == 4
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def _zero2_as_launched(monkeypatch, **overrides: str) -> dict:
    """The DeepSpeed config a process launched with deepspeed/zero2.yaml (--mixed_precision no) builds: `DeepSpeedPlugin()` from its environment."""
    from accelerate.utils import DeepSpeedPlugin

    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1",
           "ACCELERATE_GRADIENT_CLIPPING": "1.0", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
           "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "none", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false", **overrides}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision("no")
    return plugin.deepspeed_config


def test_shipped_deepspeed_settings_pass_and_autos_are_filled(monkeypatch):
    from hf_depthgrow import grow_depth
    from hf_depthgrow.testing import tiny_model
    from hf_depthgrow.training import TrainConfig
    from hf_depthgrow.training.deepspeed_support import check_deepspeed_config

    model = grow_depth(tiny_model("llama"), [2])
    ds = _zero2_as_launched(monkeypatch)
    assert ds["train_micro_batch_size_per_gpu"] == ds["train_batch_size"] == "auto"
    check_deepspeed_config(ds, TrainConfig(per_device_train_batch_size=3), model=model, num_processes=2)
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"], ds["gradient_accumulation_steps"], ds["gradient_clipping"]) == (3, 6, 1, 1.0)


@pytest.mark.parametrize(
    ("change", "train", "message"),
    [
        ({}, {"gradient_accumulation_steps": 2}, "DeepSpeed gradient_accumulation_steps=1 but TrainConfig gives 2"),
        ({}, {"max_grad_norm": 0.5}, "DeepSpeed gradient_clipping=1.0 but TrainConfig gives 0.5"),
        ({"train_micro_batch_size_per_gpu": 4}, {}, "DeepSpeed train_micro_batch_size_per_gpu=4 but TrainConfig gives 8"),
        ({"zero_optimization": {"stage": 1}}, {}, "DeepSpeed zero_stage=1 is not supported"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, {}, "DeepSpeed offload_optimizer_device='cpu'"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, {}, "DeepSpeed offload_param_device='nvme'"),
        ({"fp16": {"enabled": True}}, {}, "DeepSpeed fp16"),
        ({"bf16": {"enabled": True}}, {}, "DeepSpeed bf16 casts every weight to bf16"),
        ({"optimizer": {"type": "AdamW"}}, {}, "a DeepSpeed 'optimizer' section"),
        ({"zero_optimization": {"stage": 3}}, {"output_dir": "out"}, "ZeRO-3 needs zero3_save_16bit_model: true"),
    ],
    ids=["accumulation", "clipping", "micro-batch", "stage1", "offload-optimizer", "offload-param", "fp16", "bf16-on-fp32",
         "optimizer", "zero3-save"],
)
def test_unsupported_deepspeed_settings_are_refused(monkeypatch, change, train, message):
    """One-line ValueErrors naming the setting; `GrownTrainer` runs this check before any work."""
    from hf_depthgrow import grow_depth
    from hf_depthgrow.testing import tiny_model
    from hf_depthgrow.training import TrainConfig
    from hf_depthgrow.training.deepspeed_support import check_deepspeed_config

    ds = {**_zero2_as_launched(monkeypatch), **change}
    model = grow_depth(tiny_model("llama"), [2])
    with pytest.raises(ValueError) as err:
        check_deepspeed_config(ds, TrainConfig(**train), model=model, num_processes=2)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
