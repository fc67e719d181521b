"""Memory planner: parameter counts of the real grown model, activations as a real forward keeps them, measured peaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_depthgrow import grow_depth
from hf_depthgrow.cli import main
from hf_depthgrow.growth.towers import resolve_family
from hf_depthgrow.testing import tiny_model
from hf_depthgrow.training.config import TrainConfig
from hf_depthgrow.training.memory_plan import PlanSettings, grown_meta_model, parse_memory_size, plan_memory, saved_activations
from hf_depthgrow.training.trainable import set_train_mode, setup_trainable

from test_bad_inputs_cli import snapshot

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def config_json(tmp_path_factory) -> Path:
    """A tiny Llama as a config.json alone: what the planner needs (no weights in the folder)."""
    path = tmp_path_factory.mktemp("config") / "config.json"
    tiny_model("llama").config.to_json_file(path)
    return path


@pytest.mark.parametrize("trainable", ["new", "new+lora", "full"])
def test_planner_counts_the_parameters_of_the_real_grown_model(config_json, trainable):
    real = grow_depth(tiny_model("llama"), [2, 4])
    named = setup_trainable(real, TrainConfig(trainable=trainable, lora_r=4, lora_alpha=8)).named
    plan = plan_memory(str(config_json), PlanSettings(positions=[2, 4], trainable=trainable, lora_r=4, seq=16, batch=2))
    assert plan.parameters == sum(p.numel() for p in real.parameters())
    assert plan.trainable_parameters == sum(p.numel() for _, p in named)
    assert plan.parameter_bytes == sum(p.numel() * p.element_size() for p in real.parameters())
    assert plan.gradient_bytes == 4 * plan.trainable_parameters
    assert plan.optimizer_bytes == 12 * plan.trainable_parameters  # two fp32 moments + the step's temporaries


def _real_saved(model, batch: int, seq: int) -> list[int]:
    """Bytes autograd keeps inside each stack layer in a real CPU forward (torch's own account of saved tensors)."""
    _, stack, _ = resolve_family(model)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, seen, handles = [None], {}, []
    for i, layer in enumerate(stack):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i), prepend=True))
        handles.append(layer.register_forward_hook(lambda *a: where.__setitem__(0, None)))

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in weights and key not in seen:
            seen[key] = (where[0], t.untyped_storage().nbytes())
        return t

    ids = torch.randint(2, model.config.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.get_decoder()(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    for h in handles:
        h.remove()
    return [sum(n for w, n in seen.values() if w == i) for i in range(len(stack))]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fake_forward_keeps_what_a_real_forward_keeps(family):
    # The fake forward must take the kernels a real one takes: flash attention without a materialised mask, grouped
    # key/value heads not repeated (a meta forward keeps the [seq, seq] probabilities and is 50-90% off here).
    real = grow_depth(tiny_model(family), [2])
    set_train_mode(real, setup_trainable(real, TrainConfig()).train_modules, True)
    meta, _ = grown_meta_model(tiny_model(family).config, PlanSettings(positions=[2]))
    predicted = saved_activations(meta, 2, 64)["layers"]
    assert predicted == _real_saved(real, 2, 64)
    assert predicted[:2] == [0, 0] and all(predicted[2:])  # the frozen prefix keeps nothing


MEASURE = """
import ctypes, json, re
from pathlib import Path
import torch
from hf_depthgrow import grow_depth
from hf_depthgrow.testing import tiny_model
from hf_depthgrow.training import GrownTrainer, TrainConfig

def rss(field):
    return int(re.search(field + r":\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024

torch.set_num_threads(1)
out = {}
for on in (False, True):
    model = grow_depth(tiny_model("llama", hidden_size=64, intermediate_size=256, max_position_embeddings=512), [1])
    ids = torch.randint(2, 128, (16, 512), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]
    cfg = TrainConfig(max_steps=4, per_device_train_batch_size=8, fallback=False, prefix_cache="off", progress_bar=False,
                      gradient_checkpointing=on)
    trainer = GrownTrainer(model, cfg, rows)
    trainer.setup()
    trainer.training_step(1)  # AdamW's state exists from here on
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak counter restarts at the current RSS
    trainer.training_step(2)
    out[str(on)] = rss("VmHWM") - before
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak-RSS counter")
def test_prediction_within_15_percent_of_a_measured_training_step():
    # Honest on a tiny model: the process's size is the interpreter's, so what is compared is the step's own growth
    # of resident memory (peak during a step minus before it), with glibc mapping every buffer >= 64 KiB on its own
    # so that the resident memory follows the live tensors; the planner's share of it is activations + gradients.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", MEASURE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    config = tiny_model("llama", hidden_size=64, intermediate_size=256, max_position_embeddings=512).config
    for on in (False, True):
        plan = plan_memory(config, PlanSettings(positions=[1], seq=512, batch=8, gradient_checkpointing=on))
        predicted = plan.activation_bytes + plan.gradient_bytes
        assert abs(predicted / measured[str(on)] - 1) <= 0.15, (on, predicted, measured)
    assert measured["True"] < 0.6 * measured["False"]  # and checkpointing does save memory


def test_sharding_divides_what_it_shards(config_json):
    base = dict(positions=[2], trainable="full", seq=16, batch=2)
    one = plan_memory(str(config_json), PlanSettings(**base))
    zero2 = plan_memory(str(config_json), PlanSettings(**base, gpus=4, zero=2))
    zero3 = plan_memory(str(config_json), PlanSettings(**base, gpus=4, zero=3))
    assert zero2.parameter_bytes == one.parameter_bytes and zero2.gradient_bytes == -(-one.gradient_bytes // 4)
    assert zero3.parameter_bytes < one.parameter_bytes / 2 and zero3.optimizer_bytes == -(-one.optimizer_bytes // 4)
    assert zero3.activation_bytes == one.activation_bytes  # activations are per device
    quantized = plan_memory(str(config_json), PlanSettings(positions=[2], quantize="4bit"))
    assert quantized.parameter_bytes < one.parameter_bytes


def test_parse_memory_size():
    assert parse_memory_size("80GiB") == 80 * 2**30
    assert parse_memory_size("80GB") == 80 * 10**9
    assert parse_memory_size("24g") == 24 * 10**9
    assert parse_memory_size("1.5 TiB") == int(1.5 * 2**40)
    for bad in ("80GB?", "abc", "0GiB", "-1g", ""):
        with pytest.raises(ValueError, match="device memory"):
            parse_memory_size(bad)


def test_estimate_prints_every_arm_and_whether_it_fits(config_json, capsys):
    argv = ["estimate", "--model", str(config_json), "--positions", "2", "--trainable", "new", "full", "--block-size", "32",
            "--batch-size", "2", "--device-memory", "1MiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in ("new", "full")}
    assert set(lines) == {"new", "full"} and "fits 1.0 MiB" in out
    assert lines["new"].split()[-1] == "yes" and lines["full"].split()[-1] == "no"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--device-memory", "80GB?"], "device memory must be a size"),
        (["--device-memory", "abc"], "device memory must be a size"),
        (["--trainable", "everything"], "'everything' is not one of"),
        (["--positions", "9"], "position 9 is out of range"),
        (["--positions", "-1"], "--positions must be ints >= 0"),
        (["--zero", "3"], "ZeRO and FSDP shard over several devices"),
        (["--quantize", "4bit", "--trainable", "full"], "quantized base cannot train in full"),
    ],
)
def test_estimate_bad_input_is_one_line_exit_2_nothing_written(config_json, tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    argv = ["estimate", "--model", str(config_json), "--positions", "2", *extra]
    if "--positions" in extra:
        argv = ["estimate", "--model", str(config_json), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-depthgrow estimate: ") and message in err and len(err.splitlines()) == 1, err
    assert snapshot(tmp_path) == before
