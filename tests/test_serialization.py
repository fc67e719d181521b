"""Round trips: native growth through plain transformers, adapter growth through hf_depthgrow."""

import json

import pytest
import torch
import transformers

from hf_depthgrow import grow_depth, growth_record, load_pretrained, new_block_parameters, save_pretrained
from hf_depthgrow.hub.serialization import ADAPTER_WEIGHTS
from hf_depthgrow.testing import TINY, model_output, tiny_inputs, tiny_model


def _grown(model_type, block):
    model = tiny_model(model_type)
    grow_depth(model, [0, 2, 4], block=block)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in new_block_parameters(model):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


@pytest.mark.parametrize("model_type", [m for m in TINY if m not in ("bert", "roberta")])
def test_native_round_trip_with_plain_transformers(model_type, tmp_path):
    model = _grown(model_type, "native")
    inputs = tiny_inputs(model)
    save_pretrained(model, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert not list((tmp_path / "m").glob("*.bin")) and not list((tmp_path / "m").glob("*.pt"))
    cls = getattr(transformers, model.config.architectures[0])
    loaded = cls.from_pretrained(tmp_path / "m").eval()  # no hf_depthgrow, no remote code
    assert (model_output(loaded, inputs) - model_output(model, inputs)).abs().max().item() <= 1e-6
    assert growth_record(loaded) == growth_record(model)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["depth_growth"]["native_indices"] == [0, 3, 6]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2", "bert", "roberta", "vit", "dinov2"])
def test_adapter_round_trip(model_type, tmp_path):
    model = _grown(model_type, "adapter")
    inputs = tiny_inputs(model)
    save_pretrained(model, tmp_path / "m")
    assert (tmp_path / "m" / ADAPTER_WEIGHTS).exists()
    loaded = load_pretrained(tmp_path / "m").eval()
    assert (model_output(loaded, inputs) - model_output(model, inputs)).abs().max().item() <= 1e-6
    assert growth_record(loaded) == growth_record(model)
    # Plain transformers sees a clean base checkpoint: it loads the original model.
    cls = getattr(transformers, model.config.architectures[0])
    base = cls.from_pretrained(tmp_path / "m").eval()
    original = tiny_model(model_type)
    assert (model_output(base, inputs) - model_output(original, inputs)).abs().max().item() <= 1e-6


def test_adapters_only_save_references_the_base(tmp_path):
    base = tiny_model("bert")
    base.save_pretrained(tmp_path / "base")
    model = _grown("bert", "adapter")
    inputs = tiny_inputs(model)
    save_pretrained(model, tmp_path / "delta", adapters_only=True, base_model=str(tmp_path / "base"))
    files = sorted(p.name for p in (tmp_path / "delta").iterdir())
    assert files == ["depthgrow_adapters.json", ADAPTER_WEIGHTS]
    loaded = load_pretrained(tmp_path / "delta").eval()
    assert (model_output(loaded, inputs) - model_output(model, inputs)).abs().max().item() <= 1e-6
    with pytest.raises(ValueError, match="base_model"):
        save_pretrained(model, tmp_path / "x", adapters_only=True)
    assert not (tmp_path / "x").exists()


def test_failed_save_leaves_previous_folder_intact(tmp_path, monkeypatch):
    model = _grown("llama", "native")
    save_pretrained(model, tmp_path / "m")
    before = sorted(p.name for p in (tmp_path / "m").iterdir())

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp folder left behind


def test_missing_adapter_file_is_a_clear_error(tmp_path):
    model = _grown("bert", "adapter")
    save_pretrained(model, tmp_path / "m")
    (tmp_path / "m" / ADAPTER_WEIGHTS).unlink()
    with pytest.raises(ValueError, match="adapter blocks but depthgrow_adapters.safetensors is missing"):
        load_pretrained(tmp_path / "m")
