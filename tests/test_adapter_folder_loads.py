"""No silent bare-base loads: plain transformers on an adapter-grown folder warns, naming the command that loads it."""

import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hf_depthgrow import grow_depth, growth_record, load_pretrained, new_block_parameters, save_pretrained
from hf_depthgrow.hub.serialization import ADAPTER_WEIGHTS, NOT_LOADED_KEY

COMMAND = "hf_depthgrow.load_pretrained(folder)"


def _bert(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, vocab_size=100, max_position_embeddings=64
    )
    return transformers.BertModel(config).eval()


def _inputs():
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _hidden(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**_inputs()).last_hidden_state


def _grown_folder(path):
    """A tiny BERT grown with adapter blocks (the kind BERT takes), moved off their init, saved by hf_depthgrow."""
    model = _bert()
    grow_depth(model, [1, 4], block="adapter")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in new_block_parameters(model):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    save_pretrained(model, path)
    return model


@pytest.fixture
def transformers_log():
    """What transformers logs (its logger does not propagate to the root, so caplog would miss it)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _warnings(records) -> str:
    return "\n".join(r.getMessage() for r in records if r.levelno >= logging.WARNING)


@pytest.mark.parametrize("auto_class", ["AutoModel", "BertModel"])
def test_plain_transformers_warns_with_the_command(tmp_path, transformers_log, auto_class):
    grown = _grown_folder(tmp_path / "m")
    base = getattr(transformers, auto_class).from_pretrained(tmp_path / "m").eval()
    shown = _warnings(transformers_log)
    assert COMMAND in shown and "UNEXPECTED" in shown  # a warning the user sees by default, not logger.info
    assert "depthgrow_pre" in shown and "depthgrow_post" in shown  # which blocks were left out
    # What it loaded is the bare base, exactly: the report is the only thing that tells the user.
    assert torch.equal(_hidden(base), _hidden(_bert()))
    assert (_hidden(base) - _hidden(grown)).abs().max().item() > 1e-3


def test_the_marker_tensor_reads_as_the_instruction(tmp_path):
    _grown_folder(tmp_path / "m")
    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert NOT_LOADED_KEY.endswith(COMMAND) and NOT_LOADED_KEY in weights
    sentence = bytes(weights[NOT_LOADED_KEY].tolist()).decode()
    assert "2 depth-growth adapter block(s)" in sentence and sentence.endswith(COMMAND)
    assert sorted(k for k in weights if "depthgrow_" in k and k != NOT_LOADED_KEY) == sorted(load_file(str(tmp_path / "m" / ADAPTER_WEIGHTS)))


def test_load_pretrained_stays_exact_and_quiet(tmp_path, transformers_log):
    grown = _grown_folder(tmp_path / "m")
    loaded = load_pretrained(tmp_path / "m").eval()
    assert (_hidden(loaded) - _hidden(grown)).abs().max().item() <= 1e-6
    assert growth_record(loaded) == growth_record(grown)
    assert "depthgrow" not in _warnings(transformers_log) and COMMAND not in _warnings(transformers_log)
    assert not any(NOT_LOADED_KEY.split(".")[0] in name for name, _ in loaded.named_modules())
    # hf_depthgrow's quiet load left transformers as it was: the next plain load still warns.
    transformers_log.clear()
    transformers.BertModel.from_pretrained(tmp_path / "m")
    assert COMMAND in _warnings(transformers_log)


def test_a_folder_written_before_the_marker_still_loads(tmp_path):
    grown = _grown_folder(tmp_path / "m")
    main = tmp_path / "m" / "model.safetensors"
    save_file({k: v for k, v in load_file(str(main)).items() if "depthgrow" not in k}, str(main), metadata={"format": "pt"})
    loaded = load_pretrained(tmp_path / "m").eval()
    assert (_hidden(loaded) - _hidden(grown)).abs().max().item() <= 1e-6


def test_native_growth_stays_a_clean_checkpoint(tmp_path, transformers_log):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=100
    )
    model = grow_depth(transformers.LlamaForCausalLM(config).eval(), [2], block="native")
    save_pretrained(model, tmp_path / "m")
    assert not any("depthgrow" in k for k in load_file(str(tmp_path / "m" / "model.safetensors")))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert loaded.config.num_hidden_layers == 5 and "LOAD REPORT" not in _warnings(transformers_log)
