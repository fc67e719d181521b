"""A frozen base quantised by bitsandbytes (4-bit NF4, 8-bit): grown exactly, only the new blocks train, saved merged and blocks-only.

bitsandbytes runs on CPUs too, so these use the very backend a GPU user loads through `BitsAndBytesConfig`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from hf_depthgrow import bypass_new_blocks, grow_depth, growth_record, load_model, load_pretrained, new_block_parameters, save_pretrained
from hf_depthgrow.cli import main
from hf_depthgrow.growth.engine import new_block_modules
from hf_depthgrow.growth.quantized import bnb_mode, is_bnb_linear
from hf_depthgrow.hub.loading import check_quantizable
from hf_depthgrow.testing import tiny_inputs, tiny_model, tiny_rows
from hf_depthgrow.training import train

pytest.importorskip("bitsandbytes", reason='pip install "hf_depthgrow[quantize]"')

MODES = ("4bit", "8bit")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' per-call notes on casting inputs for 8-bit matmuls
        yield


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quant") / "tiny"
    tiny_model("llama").save_pretrained(folder)
    return folder


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits


def _quantized(base, mode):
    model, _ = load_model(base, quantize=mode)
    assert bnb_mode(model) == mode and any(is_bnb_linear(m) for m in model.modules())
    return model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("growth", [dict(block="native", init="copy"), dict(block="native", init="random"), dict(block="adapter")],
                         ids=["native-copy", "native-random", "adapter"])
def test_grown_quantized_model_at_init_equals_the_quantized_original(base, mode, growth):
    model = _quantized(base, mode)
    inputs = tiny_inputs(model)
    before = _logits(model, inputs)
    grow_depth(model, [1, 4], **growth)
    assert torch.equal(_logits(model, inputs), before)  # bit for bit: the new blocks add exactly 0
    with bypass_new_blocks(model):
        assert torch.equal(_logits(model, inputs), before)
    # New blocks are float modules, never quantised; the original layers stay quantised.
    blocks = new_block_modules(model)
    assert blocks and not any(is_bnb_linear(m) for b in blocks for m in b.modules())
    assert all(p.dtype == torch.float32 for _, p in new_block_parameters(model))
    assert sum(is_bnb_linear(m) for m in model.modules()) == 4 * 7


def test_a_copied_block_starts_from_the_dequantised_weights_of_its_source(base):
    model = _quantized(base, "4bit")
    source = model.model.layers[1].self_attn.q_proj
    from hf_depthgrow.growth.quantized import dequantized_weight

    expected = dequantized_weight(source)
    grow_depth(model, [2], block="native", init="copy")
    copied = model.model.layers[2].self_attn.q_proj
    assert type(copied) is nn.Linear and torch.equal(copied.weight.detach(), expected.float())


def test_gradients_reach_a_new_block_below_quantised_layers_after_an_eval_pass(base):
    # bitsandbytes would switch a 4-bit layer to a bf16 kernel (no input gradient) on an AVX512-BF16 CPU's
    # first eval-mode forward; the loader keeps one kernel for both, so training after evaluation still learns.
    model = _quantized(base, "4bit")
    grow_depth(model, [1])
    inputs = tiny_inputs(model)
    eval_logits = _logits(model.eval(), inputs)
    model.train()
    out = model(**inputs)
    out.loss.backward()
    grads = [p.grad for _, p in new_block_parameters(model) if p.requires_grad]
    assert grads and all(g is not None for g in grads) and any(float(g.abs().sum()) > 0 for g in grads)
    assert torch.equal(out.logits.detach(), eval_logits)  # the trained and the evaluated function are one


@pytest.fixture(scope="module", params=MODES)
def trained(request, base, tmp_path_factory):
    mode = request.param
    model = _quantized(base, mode)
    grow_depth(model, [2])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = tiny_rows(model, 8)
    out = tmp_path_factory.mktemp(f"train-{mode}")
    result = train(model, rows, eval_data=rows[:4], max_steps=2, learning_rate=1e-2, per_device_train_batch_size=4,
                   fallback=False, output_dir=str(out), progress_bar=False)
    return mode, model, before, result


def test_quantized_base_training_changes_only_the_new_blocks(trained):
    mode, model, before, result = trained
    new = {name for name, _ in new_block_parameters(model)}
    after = model.state_dict()
    changed = {k for k, v in after.items() if not torch.equal(before[k], v)}
    assert changed and changed <= new  # packed weights, quantisation states and norms of the base: untouched
    assert {n for n, p in model.named_parameters() if p.requires_grad} == new
    assert result.selected == "new" and bnb_mode(result.model) == mode


def test_merged_checkpoint_loads_with_plain_transformers(trained):
    mode, model, _, result = trained
    plain = transformers.AutoModelForCausalLM.from_pretrained(result.model_path)
    assert getattr(plain.config, "quantization_config", None) is None
    assert not any(is_bnb_linear(m) for m in plain.modules())
    assert plain.config.num_hidden_layers == 5 and growth_record(plain).native_indices == (2,)
    inputs = tiny_inputs(model)
    expected, got = _logits(model, inputs), _logits(plain, inputs)
    # 4-bit: dequantise-then-matmul in float32 on both sides. 8-bit: bitsandbytes multiplies in int8 with
    # fp16-cast inputs, the merged model in float32 on the dequantised weights: close, not equal.
    tolerance = 1e-5 if mode == "4bit" else 2e-2
    assert float((got - expected).abs().max()) <= tolerance * max(1.0, float(expected.abs().max()))
    assert bnb_mode(model) == mode  # saving dequantised a copy: the trained model stays quantised


def test_blocks_only_artifact_reloads_onto_the_quantised_base(trained, base):
    mode, model, _, result = trained
    assert result.blocks_path is not None
    meta = json.loads((Path(result.blocks_path) / "depthgrow_blocks.json").read_text())
    assert meta["quantize"] == mode and meta["base_model"] == str(base)
    reloaded = load_pretrained(result.blocks_path)
    assert bnb_mode(reloaded) == mode and growth_record(reloaded) == growth_record(model)
    inputs = tiny_inputs(model)
    assert torch.equal(_logits(reloaded, inputs), _logits(model, inputs))


def test_blocks_only_save_of_a_float_model_with_native_and_adapter_blocks(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "base")
    grow_depth(model, [1, 4], block="native")
    grow_depth(model, [2], block="adapter")
    with torch.no_grad():
        for _, p in new_block_parameters(model):
            p.add_(0.01)
    save_pretrained(model, tmp_path / "blocks", blocks_only=True, base_model=str(tmp_path / "base"))
    reloaded = load_pretrained(tmp_path / "blocks")
    inputs = tiny_inputs(model)
    assert growth_record(reloaded) == growth_record(model)
    assert torch.equal(_logits(reloaded, inputs), _logits(model, inputs))


def test_quantize_refuses_a_model_bitsandbytes_would_not_quantise(tmp_path):
    tiny_model("gpt2").save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError) as caught:
        check_quantizable(tmp_path / "gpt2", "4bit")
    assert str(caught.value) == (
        "quantize: the layers of gpt2 hold no torch.nn.Linear (Conv1D), which is all bitsandbytes quantises; "
        "load this model without quantize"
    )


def test_quantize_refuses_a_grown_folder(tmp_path):
    model = grow_depth(tiny_model("llama"), [2])
    save_pretrained(model, tmp_path / "grown")
    with pytest.raises(ValueError, match="already grown: quantize loads an ungrown base"):
        load_model(tmp_path / "grown", quantize="8bit")


def test_quantize_without_the_backend_is_one_line(base, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ValueError) as caught:
        load_model(base, quantize="4bit")
    assert str(caught.value) == "quantize='4bit' needs bitsandbytes, which is not installed: pip install \"hf_depthgrow[quantize]\""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--quantize", "4bit", "--positions", "2"], "hf-depthgrow train: quantize: the layers of gpt2 hold no torch.nn.Linear (Conv1D), which is all bitsandbytes quantises; load this model without quantize"),
        (["train", "--quantize", "2bit", "--positions", "2"], "hf-depthgrow train: --quantize must be 4bit or 8bit, got '2bit'"),
        (["run", "--quantize", "4bit", "--controls", "layers"], "hf-depthgrow run: control 'layers' trains the base's own layers, which a quantised base keeps frozen: pass control: none with quantize"),
        (["run", "--quantize", "4bit"], "hf-depthgrow run: quantize: the layers of gpt2 hold no torch.nn.Linear (Conv1D), which is all bitsandbytes quantises; load this model without quantize"),
    ],
)
def test_bad_quantize_on_the_command_line_is_one_line_and_writes_nothing(tmp_path, capsys, argv, message):
    tiny_model("gpt2").save_pretrained(tmp_path / "gpt2")
    (tmp_path / "data.txt").write_text("some text to train on\n" * 50)
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = [*argv, "--model", str(tmp_path / "gpt2"), "--data", str(tmp_path / "data.txt"), "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == message
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_train_command_with_quantize_writes_the_merged_model_and_the_blocks(tmp_path, capsys):
    from tiny_lm import make_tiny_lm

    root = make_tiny_lm(tmp_path, max_chars=4_000)
    out = tmp_path / "out"
    argv = ["train", "--model", str(root / "tiny"), "--data", str(root / "sample.txt"), "--quantize", "4bit", "--positions", "2",
            "--block-size", "16", "--max-examples", "16", "--max-steps", "2", "--batch-size", "4",
            "--output-dir", str(out), "--no-progress"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model_path"] == str(out / "model") and summary["blocks_path"] == str(out / "blocks")
    plain = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    assert plain.config.num_hidden_layers == 5 and getattr(plain.config, "quantization_config", None) is None
    reloaded = load_pretrained(out / "blocks")
    assert bnb_mode(reloaded) == "4bit" and growth_record(reloaded).native_indices == (2,)
    inputs = tiny_inputs(plain)
    assert float((_logits(reloaded, inputs) - _logits(plain, inputs)).abs().max()) <= 1e-5 * max(1.0, float(_logits(plain, inputs).abs().max()))


def test_a_blocks_only_save_with_a_missing_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "base")
    grow_depth(model, [2])
    save_pretrained(model, tmp_path / "blocks", blocks_only=True, base_model=str(tmp_path / "base"))
    weights = tmp_path / "blocks" / "depthgrow_blocks.safetensors"
    state = load_file(weights)
    state.pop("model.layers.2.mlp.down_proj.weight")
    save_file(state, weights)
    with pytest.raises(ValueError, match=r"blocks: the saved blocks do not match the growth record: missing \['model.layers.2.mlp.down_proj.weight'\]"):
        load_pretrained(tmp_path / "blocks")


@pytest.mark.parametrize("trainable", ["full", "new+lora"])
def test_training_more_than_the_new_blocks_of_a_quantised_base_is_refused(base, trainable):
    model = grow_depth(_quantized(base, "4bit"), [2])
    with pytest.raises(ValueError) as caught:
        train(model, tiny_rows(model, 4), max_steps=1, trainable=trainable)
    assert str(caught.value) == (
        f"trainable={trainable!r} with a base quantised by bitsandbytes (4bit): the base's weights are frozen and quantised, "
        "and only trainable='new' (the float new blocks) is supported on it"
    )


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's memory map (Linux)")
def test_a_quantised_base_on_cpu_lets_go_of_the_full_precision_file(base):
    import gc

    model = _quantized(base, "4bit")
    gc.collect()
    weights = str((base / "model.safetensors").resolve())
    assert not [ln for ln in Path("/proc/self/maps").read_text().splitlines() if ln.endswith(weights)]
    assert model.model.embed_tokens.weight is model.lm_head.weight or not model.config.tie_word_embeddings


@pytest.mark.slow
def test_run_command_with_quantize_grows_trains_evaluates_and_saves_both(tmp_path, capsys):
    from tiny_lm import make_tiny_lm

    root = make_tiny_lm(tmp_path, max_chars=6_000)
    out = tmp_path / "out"
    argv = ["run", "--model", str(root / "tiny"), "--data", str(root / "sample.txt"), "--output-dir", str(out), "--quantize", "4bit",
            "--positions", "2", "--block-size", "16", "--max-examples", "48", "--batch-size", "8", "--probe-max-batches", "1",
            "--stepping-stone-max-batches", "1", "--stepping-stone-refine-steps", "0", "--max-steps", "2", "--eval-steps", "1",
            "--selection-max-examples", "8", "--route-max-examples", "8", "--loss-bound", "10", "--evidence-cache", "none",
            "--no-progress"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["artifacts"]["blocks"] == "blocks" and summary.get("control") is None
    plain = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    assert getattr(plain.config, "quantization_config", None) is None and plain.config.num_hidden_layers == 5
    assert bnb_mode(load_pretrained(out / "blocks")) == "4bit"
