"""Depth growth as a registered PEFT method: exact at init, adapter-sized saves, peft's own load, disable,
merge and unload, and the combination with LoRA that peft allows."""

import importlib
import json

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import PeftType
from safetensors.torch import load_file

import hf_depthgrow.integrations.peft_method as peft_method
from hf_depthgrow import growth_record, load_pretrained, new_block_parameters, save_pretrained
from hf_depthgrow.integrations.peft_method import DepthGrowConfig, DepthGrowModel, lora_config_for_grown
from hf_depthgrow.testing import model_output, tiny_inputs, tiny_model


def _llama():
    # The brief's tiny Llama, built from its config (a fresh config each time: models share it by reference).
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=100
    )
    return transformers.LlamaForCausalLM(config).eval()


def _ids():
    return {"input_ids": torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _train_new_blocks(peft_model) -> None:
    """Move the new blocks off their exact init, as training would."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, param in peft_model.named_parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))


def test_importing_registers_the_method_idempotently():
    assert PeftType.DEPTHGROW.value == "DEPTHGROW"
    assert PEFT_TYPE_TO_TUNER_MAPPING["DEPTHGROW"] is DepthGrowModel
    assert PEFT_TYPE_TO_CONFIG_MAPPING["DEPTHGROW"] is DepthGrowConfig
    importlib.reload(peft_method)  # importing again runs the registration again
    peft_method.register(DepthGrowConfig, DepthGrowModel)

    class Other(DepthGrowModel):  # what a reload of model.py defines: another class under the same name
        pass

    peft_method.register(DepthGrowConfig, Other)
    assert PEFT_TYPE_TO_TUNER_MAPPING["DEPTHGROW"] is Other
    peft_method.register(DepthGrowConfig, DepthGrowModel)
    assert PEFT_TYPE_TO_TUNER_MAPPING["DEPTHGROW"] is DepthGrowModel
    assert [m for m in PeftType if m.value == "DEPTHGROW"] == [PeftType.DEPTHGROW]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "positions is required"),
        ({"positions": []}, "non-empty"),
        ({"positions": [-1]}, "must be >= 0"),
        ({"positions": "middle"}, "positions must be"),
        ({"positions": "probe:2"}, "ranks a probe result"),
        ({"positions": [{"at": 1, "copy_from": "x"}]}, "positions:"),
        ({"positions": [2], "block": "wide"}, "block must be one of"),
        ({"positions": [2], "init": "zeros"}, "init must be one of"),
        ({"positions": [2], "eps": 0.0}, "eps must be > 0"),
        ({"positions": [2], "seed": 1.5}, "seed must be an int"),
        ({"positions": [2], "adapter_dim": 0}, "adapter_dim must be a positive int"),
    ],
)
def test_bad_config_is_one_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DepthGrowConfig(**kwargs)


def test_config_round_trips_through_adapter_config_json(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("plan:\n  - {at: 4, copy_from: 0}\n")
    config = DepthGrowConfig(positions=str(plan), block="native", seed=3)
    assert config.positions == {"plan": [{"at": 4, "copy_from": 0}]}  # the file is read in: the adapter stands alone
    config.save_pretrained(tmp_path / "cfg")
    saved = json.loads((tmp_path / "cfg" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "DEPTHGROW" and saved["seed"] == 3
    loaded = DepthGrowConfig.from_pretrained(tmp_path / "cfg")
    assert isinstance(loaded, DepthGrowConfig) and loaded.to_dict() == config.to_dict()
    assert DepthGrowConfig(positions=(1, 3)).positions == [1, 3]
    for name, field in DepthGrowConfig.__dataclass_fields__.items():
        assert field.metadata.get("help"), name


@pytest.mark.parametrize("model_type, kind", [("llama", "native"), ("qwen2", "native"), ("mistral", "native"), ("gemma", "native"), ("bert", "adapter")])
def test_exact_at_init_and_only_the_new_blocks_train(model_type, kind):
    model = tiny_model(model_type)
    inputs = tiny_inputs(model)
    before = model_output(model, inputs)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = get_peft_model(model, DepthGrowConfig(positions=[0, 2, 4]))
    assert growth_record(model).block_kinds == (kind,)
    assert _max_diff(model_output(peft_model, inputs), before) <= 1e-6
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable == {"base_model.model." + n for n, _ in new_block_parameters(model)} and trainable

    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
    new_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    peft_model.train()
    loss = peft_model(**inputs).loss
    loss.backward()
    optimizer.step()
    peft_model.eval()
    changed = [n for n, p in peft_model.named_parameters() if p.requires_grad and not torch.equal(p, new_before[n])]
    assert changed  # the zero-initialised outputs get a gradient and move
    with peft_model.disable_adapter():  # the base weights did not move: the original model is intact
        assert _max_diff(model_output(peft_model, inputs), before) <= 1e-6
        assert all(torch.equal(v, base_state[k]) for k, v in model.state_dict().items() if k in base_state)


def test_save_writes_only_the_new_blocks_and_from_pretrained_restores_them(tmp_path):
    peft_model = get_peft_model(_llama(), DepthGrowConfig(positions=[2], block="native", init="copy"))
    _train_new_blocks(peft_model)
    grown = peft_model.base_model.model
    trained = model_output(peft_model, _ids())
    peft_model.save_pretrained(tmp_path / "adapter")

    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files <= {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert set(saved) == {"base_model.model." + n for n, _ in new_block_parameters(grown)}
    assert all(k.startswith("base_model.model.model.layers.2.") for k in saved)

    # Measured against the full model's own save: the adapter holds one layer's bytes out of the whole.
    grown.save_pretrained(tmp_path / "full")
    adapter_bytes = (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size
    full_bytes = (tmp_path / "full" / "model.safetensors").stat().st_size
    new_numel = sum(p.numel() for _, p in new_block_parameters(grown))
    total_numel = sum(p.numel() for p in grown.parameters())
    assert new_numel * 4 <= adapter_bytes <= new_numel * 4 + 16_384  # fp32 tensors plus the safetensors header
    assert adapter_bytes / full_bytes == pytest.approx(new_numel / total_numel, abs=0.01)
    assert adapter_bytes < full_bytes / 5

    loaded = PeftModel.from_pretrained(_llama(), tmp_path / "adapter")
    assert _max_diff(model_output(loaded, _ids()), trained) <= 1e-6
    assert not any(p.requires_grad for p in loaded.parameters())  # inference by default, as for every peft method
    trainable = PeftModel.from_pretrained(_llama(), tmp_path / "adapter", is_trainable=True)
    assert {n for n, p in trainable.named_parameters() if p.requires_grad} == set(saved)


def test_disable_adapter_gives_the_original_outputs():
    base = _llama()
    original = model_output(base, _ids())
    peft_model = get_peft_model(base, DepthGrowConfig(positions=[1, 4]))
    _train_new_blocks(peft_model)
    trained = model_output(peft_model, _ids())
    assert _max_diff(trained, original) > 1e-3
    with peft_model.disable_adapter():
        assert _max_diff(model_output(peft_model, _ids()), original) <= 1e-6
        assert len(base.model.layers) == 4 and base.config.num_hidden_layers == 4
    assert _max_diff(model_output(peft_model, _ids()), trained) == 0.0
    assert base.config.num_hidden_layers == 6


def test_merge_and_unload_is_a_plain_transformers_model(tmp_path):
    peft_model = get_peft_model(_llama(), DepthGrowConfig(positions=[2], block="native"))
    _train_new_blocks(peft_model)
    trained = model_output(peft_model, _ids())
    merged = peft_model.merge_and_unload()
    assert type(merged) is transformers.LlamaForCausalLM and merged.config.num_hidden_layers == 5
    assert not hasattr(merged, "peft_config") and not any(isinstance(m, BaseTunerLayer) for m in merged.modules())
    merged.save_pretrained(tmp_path / "grown")  # transformers' own save
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "grown").eval()
    assert type(reloaded) is transformers.LlamaForCausalLM and reloaded.config.num_hidden_layers == 5
    assert _max_diff(model_output(reloaded, _ids()), trained) <= 1e-6
    ids = _ids()["input_ids"]
    assert torch.equal(merged.generate(ids, max_new_tokens=6, do_sample=False), reloaded.generate(ids, max_new_tokens=6, do_sample=False))


def test_unload_gives_back_the_ungrown_base():
    base = _llama()
    original = model_output(base, _ids())
    peft_model = get_peft_model(base, DepthGrowConfig(positions=[2, 2]))
    _train_new_blocks(peft_model)
    unloaded = peft_model.unload()
    assert unloaded is base and len(base.model.layers) == 4 and base.config.num_hidden_layers == 4
    assert growth_record(base) is None
    assert [layer.self_attn.layer_idx for layer in base.model.layers] == [0, 1, 2, 3]
    assert _max_diff(model_output(base, _ids()), original) == 0.0


def test_causal_lm_task_generates_what_the_original_does():
    base = _llama()
    ids = _ids()["input_ids"]
    expected = base.generate(ids, max_new_tokens=8, do_sample=False)
    peft_model = get_peft_model(base, DepthGrowConfig(positions="interleave:2", task_type="CAUSAL_LM"))
    assert type(peft_model).__name__ == "PeftModelForCausalLM" and base.config.num_hidden_layers == 6
    assert torch.equal(peft_model.generate(input_ids=ids, max_new_tokens=8, do_sample=False), expected)


def test_adapter_blocks_of_a_post_norm_encoder(tmp_path):
    base = tiny_model("bert")
    inputs = tiny_inputs(base)
    original = model_output(base, inputs)
    peft_model = get_peft_model(base, DepthGrowConfig(positions=[1, 4]))  # auto: adapters, the exact kind for BERT
    assert growth_record(base).block_kinds == ("adapter",)
    assert _max_diff(model_output(peft_model, inputs), original) <= 1e-6
    _train_new_blocks(peft_model)
    trained = model_output(peft_model, inputs)
    peft_model.save_pretrained(tmp_path / "adapter")
    assert all(".depthgrow_" in k for k in load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    loaded = PeftModel.from_pretrained(tiny_model("bert"), tmp_path / "adapter")
    assert _max_diff(model_output(loaded, inputs), trained) <= 1e-6
    with loaded.disable_adapter():
        assert _max_diff(model_output(loaded, inputs), original) <= 1e-6
    # Adapter blocks are no transformers layer: the merged model travels through hf_depthgrow's own save/load.
    merged = loaded.merge_and_unload()
    save_pretrained(merged, tmp_path / "merged")
    assert _max_diff(model_output(load_pretrained(tmp_path / "merged").eval(), inputs), trained) <= 1e-6


def test_refusals_are_clear_and_leave_the_model_alone(tmp_path):
    base = _llama()
    with pytest.raises(ValueError, match="out of range|0..4|<= 4"):
        get_peft_model(base, DepthGrowConfig(positions=[9]))
    assert base.config.num_hidden_layers == 4 and growth_record(base) is None

    peft_model = get_peft_model(base, DepthGrowConfig(positions=[2]))
    # peft itself refuses to mix types; a second growth is refused by the method.
    with pytest.raises(ValueError, match="not compatible with the `PeftMixedModel`"):
        get_peft_model(_llama(), DepthGrowConfig(positions=[2]), mixed=True)
    with pytest.raises(ValueError, match="Cannot combine adapters with different peft types"):
        peft_model.add_adapter("extra", LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="one growth per model"):
        peft_model.add_adapter("second", DepthGrowConfig(positions=[1]))
    assert base.config.num_hidden_layers == 5 and list(peft_model.peft_config) == ["default"]
    with pytest.raises(ValueError, match="already grown"):
        get_peft_model(peft_model.merge_and_unload(), DepthGrowConfig(positions=[1]))

    other = get_peft_model(_llama(), DepthGrowConfig(positions=[1, 3]))
    other.save_pretrained(tmp_path / "two_blocks")
    with pytest.raises(ValueError, match="does not hold this growth's blocks"):
        PeftModel.from_pretrained(_llama(), tmp_path / "two_blocks", config=DepthGrowConfig(positions=[2]))


def test_lora_on_the_original_layers_after_growth(tmp_path):
    base = _llama()
    original = model_output(base, _ids())
    grown = get_peft_model(base, DepthGrowConfig(positions=[2], block="native")).merge_and_unload()
    lora_model = get_peft_model(grown, lora_config_for_grown(grown, r=4, target_modules=["q_proj", "v_proj"]))
    assert _max_diff(model_output(lora_model, _ids()), original) <= 1e-6  # LoRA's B = 0, the block's outputs = 0
    trainable = [n for n, p in lora_model.named_parameters() if p.requires_grad]
    assert any(".layers.2.modules_to_save." in n for n in trainable)  # the new layer trains in full
    assert not any(".layers.2." in n and "lora_" in n for n in trainable)  # no LoRA on it
    assert {n.split(".layers.")[1].split(".")[0] for n in trainable if "lora_" in n} == {"0", "1", "3", "4"}

    optimizer = torch.optim.SGD([p for p in lora_model.parameters() if p.requires_grad], lr=0.5)
    lora_model.train()
    ids = _ids()["input_ids"]
    lora_model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    lora_model.eval()
    trained = model_output(lora_model, _ids())
    assert _max_diff(trained, original) > 1e-4
    lora_model.save_pretrained(tmp_path / "lora")

    regrown = get_peft_model(_llama(), DepthGrowConfig(positions=[2], block="native")).merge_and_unload()
    reloaded = PeftModel.from_pretrained(regrown, tmp_path / "lora")
    assert _max_diff(model_output(reloaded, _ids()), trained) <= 1e-6
    with pytest.raises(ValueError, match="not grown"):
        lora_config_for_grown(_llama(), r=4)
    with pytest.raises(ValueError, match="set from the growth record"):
        lora_config_for_grown(grown, modules_to_save=["lm_head"])


def test_transformers_load_adapter_replays_the_growth(tmp_path):
    # transformers' own PEFT integration (model.load_adapter) goes through the same registered hooks.
    peft_model = get_peft_model(_llama(), DepthGrowConfig(positions=[2]))
    _train_new_blocks(peft_model)
    trained = model_output(peft_model, _ids())
    peft_model.save_pretrained(tmp_path / "adapter")
    model = _llama()
    model.load_adapter(str(tmp_path / "adapter"))
    assert model.config.num_hidden_layers == 5
    assert _max_diff(model_output(model, _ids()), trained) <= 1e-6
