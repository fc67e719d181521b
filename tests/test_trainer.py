"""Trainer: trainable sets, frozen-prefix caching, fallback rule, atomic checkpoints, resume, 2-process DDP.

Everything runs on tiny models from `hf_depthgrow.testing`, on CPU, offline. Two tests start real
subprocesses (`--stop-after-step` crash + resume; `accelerate launch --num_processes 2`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_depthgrow import grow_depth, new_block_parameters
from hf_depthgrow.testing import model_output, tiny_inputs, tiny_model
from hf_depthgrow.training.config import TrainConfig
from hf_depthgrow.training.trainer import STOP_EXIT_CODE, GrownTrainer, train

REPO = Path(__file__).resolve().parents[1]



def lm_rows(n: int, seq: int = 16, seed: int = 0, vocab: int = 128) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, seq), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i.clone()} for i in ids]


def cls_rows(n: int, seq: int = 12, seed: int = 0, labels: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 128, (n, seq), generator=g)
    ys = torch.randint(0, labels, (n,), generator=g)
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, ys)]


def quick(**kw) -> TrainConfig:
    base = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1, progress_bar=False, fallback=False)
    return TrainConfig(**{**base, **kw})


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "bad",
    [
        dict(trainable="adapters"),
        dict(trainable="layers"),  # needs trainable_layers
        dict(trainable="layers", trainable_layers=[1, 1]),
        dict(learning_rate=0),
        dict(gradient_accumulation_steps=0),
        dict(trainable="full", prefix_cache="memory"),
        dict(save_steps=5),  # no output_dir
        dict(warmup_steps=5, warmup_ratio=0.1),
        dict(prefix_cache_dtype="int8"),
        dict(max_steps=0),
        dict(lora_target_modules=[]),
    ],
)
def test_config_rejects(bad):
    with pytest.raises(ValueError):
        TrainConfig(**bad)


def test_ungrown_model_is_refused_unless_full():
    with pytest.raises(ValueError, match="not grown"):
        train(tiny_model("llama"), lm_rows(8), config=quick())


# ----------------------------------------------------------------------------- trainable sets


@pytest.mark.parametrize("model_type, block, rows", [("llama", "native", lm_rows), ("bert", "adapter", cls_rows)])
def test_new_trains_only_new_blocks(model_type, block, rows):
    model = grow_depth(tiny_model(model_type), [2], block=block)
    new_names = {n for n, _ in new_block_parameters(model)}
    before = snapshot(model)
    result = train(model, rows(16), eval_data=rows(8, seed=1), config=quick(prefix_cache="memory"))
    after = snapshot(result.model)
    assert result.history and all("loss" in h for h in result.history)  # the loss is logged
    for name, value in before.items():
        if name in new_names:
            continue
        assert torch.equal(value, after[name]), f"original weight {name} changed"
    changed = [n for n in new_names if not torch.equal(before[n], after[n])]
    # Every new parameter that gets a gradient moves (RMSNorm/LayerNorm weights too).
    assert set(changed) == new_names
    assert result.prefix_cache is not None and result.prefix_cache["index"] == 2


def test_new_plus_lora_trains_lora_and_new_blocks_and_merges():
    model = grow_depth(tiny_model("llama"), [2], block="native")
    new_names = {n for n, _ in new_block_parameters(model)}
    before = snapshot(model)
    result = train(model, lm_rows(16), config=quick(trainable="new+lora", merge_lora=False, lora_r=4))
    peft_model = result.model
    named = dict(peft_model.get_base_model().named_parameters())
    lora = {n: p for n, p in named.items() if "lora_" in n}
    # LoRA sits only on the original layers above the insertion (stack indices 3 and 4; 2 is new).
    assert {n.split(".")[2] for n in lora} == {"3", "4"}
    assert all(not torch.equal(p, torch.zeros_like(p)) for n, p in lora.items() if "lora_B" in n)
    for n in new_names:
        assert not torch.equal(before[n], named[n].detach()), f"new weight {n} did not change"
    for n, p in named.items():  # frozen originals keep their bits (LoRA wraps them as base_layer)
        original = n.replace(".base_layer", "")
        if "lora_" not in n and original not in new_names:
            assert torch.equal(before[original], p.detach()), n
    inputs = tiny_inputs(peft_model.get_base_model())
    with_lora = model_output(peft_model, inputs)
    merged = peft_model.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(model_output(merged, inputs), with_lora, rtol=1e-5, atol=1e-5)


def test_full_trains_everything_and_turns_cache_off():
    model = grow_depth(tiny_model("llama"), [2], block="native")
    before = snapshot(model)
    result = train(model, lm_rows(16), config=quick(trainable="full"))
    after = snapshot(result.model)
    assert result.prefix_cache is None
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])
    assert result.num_trainable_parameters == sum(p.numel() for p in result.model.parameters())


# ----------------------------------------------------------------------------- prefix cache


@pytest.mark.parametrize("model_type", ["llama", "vit"])
def test_prefix_at_the_top_of_the_stack_equals_a_full_forward(model_type):
    # Regression: a block grown on top of the stack (k = L) with the fallback rule on crashed with
    # "index L is outside the layer stack": f_old's cached prefix inside the bypass starts at L.
    from hf_depthgrow import bypass_new_blocks
    from hf_depthgrow.growth.prefix import prefix_hidden, start_at

    model = tiny_model(model_type).eval()
    batch = tiny_inputs(model)
    top = model.config.num_hidden_layers
    full = model_output(model, batch)
    z = prefix_hidden(model, batch, top)
    with start_at(model, top, z):
        torch.testing.assert_close(model_output(model, batch), full, rtol=0, atol=0)
    grow_depth(model, [top])
    with bypass_new_blocks(model), start_at(model, top, z):
        torch.testing.assert_close(model_output(model, batch), full, rtol=0, atol=0)


def test_top_of_stack_block_trains_with_the_fallback_rule_and_prefix_cache():
    model = grow_depth(tiny_model("llama"), [4])
    result = train(model, lm_rows(16), config=quick(max_steps=2, prefix_cache="memory", fallback=True))
    assert result.prefix_cache is not None and result.selected in ("new", "old")


@pytest.mark.parametrize("model_type, block, rows", [("llama", "native", lm_rows), ("bert", "adapter", cls_rows)])
def test_prefix_cache_gives_the_same_losses(model_type, block, rows, tmp_path):
    data, losses, weights = rows(24), {}, {}
    for mode in ("off", "memory", "disk"):
        model = grow_depth(tiny_model(model_type), [2], block=block)
        cfg = quick(max_steps=5, prefix_cache=mode, prefix_cache_dir=str(tmp_path), gradient_accumulation_steps=2, per_device_train_batch_size=2)
        result = train(model, data, config=cfg)
        losses[mode] = torch.tensor([h["loss"] for h in result.history], dtype=torch.float64)
        weights[mode] = {n: p.detach() for n, p in new_block_parameters(result.model)}
        assert (result.prefix_cache is None) == (mode == "off")
    assert len(losses["off"]) == 5
    for mode in ("memory", "disk"):
        rel = ((losses[mode] - losses["off"]).abs() / losses["off"].abs()).max().item()
        assert rel <= 1e-5, (mode, rel)
        for n, w in weights["off"].items():
            torch.testing.assert_close(weights[mode][n], w, rtol=1e-5, atol=1e-6)
    assert not list(tmp_path.glob("*.bin"))  # the disk cache is removed at the end


def test_prefix_cache_bfloat16_storage_is_close():
    data = lm_rows(16)
    results = {}
    for dtype in ("auto", "bfloat16"):
        model = grow_depth(tiny_model("llama"), [2], block="native")
        results[dtype] = train(model, data, config=quick(prefix_cache="memory", prefix_cache_dtype=dtype))
    assert results["bfloat16"].prefix_cache["bytes"] * 2 == results["auto"].prefix_cache["bytes"]
    a = [h["loss"] for h in results["auto"].history]
    b = [h["loss"] for h in results["bfloat16"].history]
    assert max(abs(x - y) for x, y in zip(a, b)) < 2e-2


# ----------------------------------------------------------------------------- fallback rule


def bigram_rows(n: int, seq: int = 16, seed: int = 0) -> list[dict]:
    """Sequences of a fixed bigram map: learnable, so a trained model beats a wrecked one."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for s in torch.randint(2, 128, (n,), generator=g).tolist():
        tokens = [s]
        for _ in range(seq - 1):
            tokens.append((tokens[-1] * 5 + 3) % 126 + 2)
        ids = torch.tensor(tokens)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return rows


@pytest.fixture(scope="module")
def fitted_llama_state():
    """A tiny Llama fitted to the bigram data (the trainer in `full` mode on an ungrown model)."""
    torch.set_num_threads(1)
    model = tiny_model("llama")
    result = train(model, bigram_rows(64), config=quick(trainable="full", max_steps=40, per_device_train_batch_size=8, logging_steps=10))
    assert result.history[-1]["loss"] < 3.5
    return {k: v.clone() for k, v in result.model.state_dict().items()}


def fitted_llama(state) -> torch.nn.Module:
    model = tiny_model("llama")
    model.load_state_dict(state)
    return model.eval()


def test_fallback_keeps_a_good_run(fitted_llama_state):
    model = grow_depth(fitted_llama(fitted_llama_state), [2], block="native")
    result = train(model, bigram_rows(16, seed=1), config=quick(max_steps=8, fallback=True))
    assert result.selected == "new"
    assert result.reference == "old"
    assert result.delta_erm >= 0
    assert result.delta_erm == pytest.approx(result.train_losses["old"] - result.train_losses["new"])


@pytest.mark.parametrize("lr", [1.0, 50.0], ids=["wrecked", "diverged"])
def test_fallback_returns_the_original_after_a_bad_run(fitted_llama_state, lr):
    original = fitted_llama(fitted_llama_state)
    inputs = tiny_inputs(original)
    expected = model_output(original, inputs)
    model = grow_depth(fitted_llama(fitted_llama_state), [2], block="native")
    init = {n: p.detach().clone() for n, p in new_block_parameters(model)}
    # A huge learning rate without clipping wrecks the new block (lr=50 drives the loss to NaN).
    result = train(model, bigram_rows(16, seed=1), config=quick(learning_rate=lr, max_grad_norm=None, fallback=True))
    assert result.selected == "old"
    assert not result.train_losses["new"] <= result.train_losses["old"]  # NaN-safe
    assert not result.delta_erm >= 0
    # f_old is returned as the grown model with its new blocks back at zero init: the same function.
    for n, p in new_block_parameters(result.model):
        assert torch.equal(p, init[n])
    torch.testing.assert_close(model_output(result.model, inputs), expected, rtol=0, atol=1e-6)
    assert result.eval_loss_selected == result.eval_loss_before


def test_fallback_with_stepping_stone_both_directions(fitted_llama_state):
    from hf_depthgrow.probe.stepping_stone import stepping_stone

    data = bigram_rows(16, seed=1)
    batch = {k: torch.stack([r[k] for r in data]) for k in data[0]}
    stone, info = stepping_stone(fitted_llama(fitted_llama_state), 2, [batch])
    assert info.loss_stone < info.loss_old

    good = train(grow_depth(fitted_llama(fitted_llama_state), [2], block="native"), data,
                 stepping_stone=(stone, info), config=quick(max_steps=10, fallback=True))
    assert good.reference == "stepping_stone" and good.selected == "new"
    # L_S(f~_S) from the trainer agrees with the stepping stone's own line search.
    assert good.train_losses["stepping_stone"] == pytest.approx(info.loss_stone, rel=1e-5)
    assert good.delta_erm == pytest.approx(good.train_losses["stepping_stone"] - good.train_losses["new"])
    assert good.delta_erm >= 0

    bad = train(grow_depth(fitted_llama(fitted_llama_state), [2], block="native"), data,
                stepping_stone=(stone, info), config=quick(learning_rate=1.0, max_grad_norm=None, fallback=True))
    assert bad.selected == "stepping_stone" and bad.delta_erm < 0
    assert bad.model is stone
    assert bad.stepping_stone["eta"] == info.eta


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    (tmp_path / ".checkpoint-9.tmp").mkdir()  # what a crash mid-save leaves behind
    model = grow_depth(tiny_model("llama"), [2], block="native")
    result = train(model, lm_rows(16), config=quick(max_steps=5, output_dir=str(tmp_path), save_steps=1, save_total_limit=2))
    names = [p.name for p in GrownTrainer.list_checkpoints(tmp_path)]
    assert names == ["checkpoint-4", "checkpoint-5"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-") and p.name != ".checkpoint-9.tmp"]
    state = json.loads((tmp_path / "checkpoint-5" / "trainer_state.json").read_text())
    assert state["global_step"] == 5 and len(state["history"]) == 5
    # The final model is a plain transformers checkpoint (native growth).
    from transformers import LlamaForCausalLM

    reloaded = LlamaForCausalLM.from_pretrained(result.model_path)
    inputs = tiny_inputs(reloaded)
    torch.testing.assert_close(model_output(reloaded, inputs), model_output(result.model, inputs))


# ----------------------------------------------------------------------------- subprocesses


def _fixture_files(root: Path, dropout: float = 0.0) -> tuple[Path, Path]:
    """A saved (ungrown) tiny Llama, and a pre-tokenised data set on disk."""
    import datasets

    from hf_depthgrow.hub.serialization import save_pretrained

    base, ds = root / "base", root / "ds"
    save_pretrained(tiny_model("llama", attention_dropout=dropout), base)
    rows = lm_rows(48, seq=16, seed=3)
    datasets.Dataset.from_dict({k: torch.stack([r[k] for r in rows]).numpy() for k in rows[0]}).save_to_disk(str(ds))
    return base, ds


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _final_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(output_dir / "model" / "model.safetensors"))


def _common_args(base: Path, ds: Path, out: Path) -> list[str]:
    return [
        "--model", str(base), "--positions", "2", "--dataset", str(ds), "--held-out-fraction", "0.25",
        "--learning-rate", "5e-3", "--max-steps", "6", "--logging-steps", "1", "--no-progress",
        "--seed", "5", "--output-dir", str(out), "--fallback", "false",
    ]


def test_killed_run_resumes_to_the_same_weights(tmp_path):
    from hf_depthgrow.cli.train import main

    # Dropout in the new block and in LoRA: the resumed run must restore the RNG streams too.
    base, ds = _fixture_files(tmp_path, dropout=0.1)
    args = lambda out: _common_args(base, ds, out) + [  # noqa: E731
        "--trainable", "new+lora", "--lora-dropout", "0.1", "--lora-r", "4",
        "--batch-size", "4", "--gradient-accumulation-steps", "2", "--save-steps", "2",
    ]
    crashed = tmp_path / "crashed"
    # A real process that hard-exits (os._exit, no cleanup) after step 3: the work of step 3 is lost,
    # checkpoint-2 is the last one on disk.
    proc = subprocess.run(
        [sys.executable, "-m", "hf_depthgrow.cli.train", *args(crashed), "--stop-after-step", "3"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == STOP_EXIT_CODE, proc.stderr[-3000:]
    assert [p.name for p in GrownTrainer.list_checkpoints(crashed)] == ["checkpoint-2"]
    assert not (crashed / "model").exists()

    assert main(args(crashed) + ["--resume-from-checkpoint", "latest"]) == 0
    resumed = json.loads((crashed / "train_result.json").read_text())
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["global_step"] == 6
    straight = tmp_path / "straight"
    assert main(args(straight)) == 0
    a, b = _final_weights(crashed), _final_weights(straight)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bit-identical (same seed, CPU, one thread)
    history = json.loads((straight / "train_result.json").read_text())["history"]
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in history]


def test_two_processes_match_one(tmp_path):
    """Two CPU processes (gloo DDP) under `accelerate launch` vs one process with the same global batch.

    Tolerance: max |w_2proc - w_1proc| <= 5e-5 (fp32; 1% of one Adam step at lr 5e-3; measured
    6e-6 after 6 steps). The two runs see the same examples in every step and the same global
    token-weighted loss; only the summation order of the gradient (all-reduce of two halves) differs.

    Launch: in accelerate 1.16 `--cpu` selects the single-process launcher (several CPU processes
    need an MPI hostfile), so two CPU processes come from the torchrun-based `--multi_gpu` launcher
    with `ACCELERATE_USE_CPU=true`, which makes accelerate pick the gloo backend (MULTI_CPU).

    The two-process run also checkpoints its activations (`--gradient-checkpointing`): the recomputation under
    DDP must give the same gradients as the single plain process.
    """
    from hf_depthgrow.cli.train import main

    base, ds = _fixture_files(tmp_path)  # no dropout: random streams differ between layouts
    two, one = tmp_path / "two", tmp_path / "one"
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29731",
        "-m", "hf_depthgrow.cli.train", *_common_args(base, ds, two),
        "--batch-size", "2", "--ddp-timeout", "120", "--fallback", "true", "--gradient-checkpointing",
    ]
    proc = subprocess.run(cmd, env={**_env(), "ACCELERATE_USE_CPU": "true"}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert main(_common_args(base, ds, one) + ["--batch-size", "4", "--fallback", "true"]) == 0
    a, b = _final_weights(two), _final_weights(one)
    assert a.keys() == b.keys()
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    assert worst <= 5e-5, worst
    ra = json.loads((two / "train_result.json").read_text())
    rb = json.loads((one / "train_result.json").read_text())
    assert ra["num_processes"] == 2 and rb["num_processes"] == 1
    assert ra["prefix_cache"]["mode"] == "memory"  # the cache was built across both processes
    for x, y in zip(ra["history"], rb["history"]):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    assert ra["train_losses"]["new"] == pytest.approx(rb["train_losses"]["new"], rel=1e-5)
    assert ra["selected"] == rb["selected"]
