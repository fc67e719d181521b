"""Families the table does not name: their layout is inferred, native growth is exact and saves a vanilla checkpoint.

Each family here is built tiny from its transformers config class (fp32, non-trivial norm weights)
and is *not* a row of `FAMILIES`: `resolve_family` infers its row (`growth/inference.py`). The
native ones must grow natively, compute exactly what they did (logits and greedy decoding with the
KV cache, past the sliding window where the family has one), and save a checkpoint that plain
`AutoModelForCausalLM.from_pretrained` loads at the grown depth with equal logits. The others must
fall back to adapter blocks with a warning that names the reason.
"""

import copy
import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_depthgrow import FAMILIES, grow_depth, growth_record, new_block_parameters, save_pretrained
from hf_depthgrow.growth import inference, trial
from hf_depthgrow.growth.towers import resolve_family

TOL = 1e-6
WINDOW = 6
_BASE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_key_value_heads=2, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

# model_type -> (config kwargs, the residual outputs the inference must find)
NATIVE = {
    "olmo2": (dict(num_key_value_heads=2), ("self_attn.o_proj", "mlp.down_proj")),
    "cohere2": (dict(num_key_value_heads=2, sliding_window=WINDOW), ("self_attn.o_proj", "mlp.down_proj")),
    "phi": (dict(partial_rotary_factor=0.5), ("self_attn.dense", "mlp.fc2")),
    "gptj": (dict(n_embd=32, n_layer=4, n_head=4, n_positions=128, rotary_dim=4), ("attn.out_proj", "mlp.fc_out")),
    "gpt_neo": (dict(num_layers=4, attention_types=[[["global", "local"], 2]], window_size=WINDOW),
                ("attn.attention.out_proj", "mlp.c_proj")),
    "opt": (dict(ffn_dim=64, word_embed_proj_dim=32), ("self_attn.out_proj", "fc2")),
    # Falcon adds the attention output to the MLP's in place: what a writer returned must be read at once.
    "falcon": (dict(num_kv_heads=2, parallel_attn=True), ("self_attention.dense", "mlp.dense_4h_to_h")),
    "mixtral": (dict(_MOE), ("self_attn.o_proj", "mlp.experts.down_proj")),
    "qwen2_moe": (dict(_MOE, shared_expert_intermediate_size=32),
                  ("self_attn.o_proj", "mlp.shared_expert.down_proj", "mlp.experts.down_proj")),
}
# model_type -> (config kwargs, what the warning and the refusal of block="native" must say)
FALLBACK = {
    "opt": (dict(ffn_dim=64, word_embed_proj_dim=32, do_layer_norm_before=False), "post-norm: zeroed branch still normalises"),
    "diffllama": (dict(num_key_value_heads=2), "a layer's construction depends on its index"),
}


def tiny(model_type, **kwargs):
    """A tiny fp32 causal LM of `model_type` in eval mode, norm weights drawn away from 1 and biases from 0."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**{**_BASE, **kwargs}))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if "norm" in type(module).__name__.lower() or isinstance(module, torch.nn.LayerNorm):
                for name, scale in (("weight", 0.5), ("bias", 0.1)):
                    value = getattr(module, name, None)
                    if isinstance(value, torch.Tensor):
                        value.add_(scale * torch.randn(value.shape, generator=generator))
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def greedy(model, prompt, use_cache=True):
    steps = 2 * WINDOW  # prompt + continuation well past the sliding window
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, use_cache=use_cache, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def max_diff(a, b):
    return (a - b).abs().max().item()


IDS = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))


def test_the_families_here_are_not_in_the_table():
    assert not (set(NATIVE) | set(FALLBACK)) & set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(NATIVE))
def test_inferred_family_grows_natively_exactly_and_saves_a_vanilla_checkpoint(model_type, tmp_path):
    kwargs, outputs = NATIVE[model_type]
    model = tiny(model_type, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a family that goes native is grown without a fallback warning
        spec, stack, _ = resolve_family(model)
    assert spec.inferred and spec.fallback_reason == "" and spec.norm_style == "pre"
    assert spec.residual_outputs == outputs
    layers = len(stack)
    before, (ref_seq, ref_scores) = logits(model, IDS), greedy(model, IDS[:1, :8])

    grown = grow_depth(copy.deepcopy(model), [0, layers // 2, layers])
    record = growth_record(grown)
    assert record.block_kinds == ("native",) and record.native_indices == (0, layers // 2 + 1, layers + 2)
    assert grown.config.num_hidden_layers == layers + 3
    assert max_diff(logits(grown, IDS), before) <= TOL
    for use_cache in (True, False):
        seq, scores = greedy(grown, IDS[:1, :8], use_cache)
        assert torch.equal(seq, ref_seq) and max_diff(scores, ref_scores) <= TOL, use_cache

    save_pretrained(grown, tmp_path / "grown")
    saved = json.loads((tmp_path / "grown" / "config.json").read_text())
    assert saved["model_type"] == model_type and "auto_map" not in saved
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "grown").eval()  # plain transformers, no hf_depthgrow
    assert type(reloaded) is type(model) and len(resolve_family(reloaded)[1]) == layers + 3
    assert max_diff(logits(reloaded, IDS), before) <= TOL


@pytest.mark.parametrize("model_type", ["mixtral", "phi"])
def test_new_blocks_are_real_and_only_their_output_projections_start_at_zero(model_type):
    kwargs, outputs = NATIVE[model_type]
    model = tiny(model_type, **kwargs)
    before = logits(model, IDS)
    grown = grow_depth(copy.deepcopy(model), [2], init="random", seed=3)
    block = resolve_family(grown)[1][2]
    zeroed = {name for name, _ in block.named_parameters() if any(name.startswith(o) for o in outputs)}
    assert zeroed and all(p.abs().max() == 0 for n, p in block.named_parameters() if n in zeroed)
    # The expert bank's gate/up projection keeps its values: the gradient at zero init does not vanish.
    assert any(p.abs().max() > 0 for n, p in block.named_parameters() if n not in zeroed and p.dim() >= 2)
    assert max_diff(logits(grown, IDS), before) <= TOL
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in new_block_parameters(grown):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    assert max_diff(logits(grown, IDS), before) > 1e-4


def test_index_attributes_other_than_layer_idx_are_found_and_renumbered():
    model = tiny("gpt_neo", **NATIVE["gpt_neo"][0])
    spec, stack, _ = resolve_family(model)
    assert spec.index_attrs == ("layer_idx", "layer_id")  # GPT-Neo keeps its KV-cache slot in `layer_id`
    grow_depth(model, [1, 3])
    assert [layer.attn.attention.layer_id for layer in stack] == list(range(6))


def test_inference_leaves_the_model_alone_and_runs_once_per_family(monkeypatch):
    inference.clear_cache()
    model = tiny("olmo2", **NATIVE["olmo2"][0])
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config_json, layer_ids = model.config.to_json_string(), [id(m) for m in model.model.layers]
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    calls = []
    real = trial.native_trial
    monkeypatch.setattr(trial, "native_trial", lambda *a: calls.append(1) or real(*a))
    resolve_family(model)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.config.to_json_string() == config_json and [id(m) for m in model.model.layers] == layer_ids
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    resolve_family(model)
    resolve_family(tiny("olmo2", **NATIVE["olmo2"][0]))  # same family, same switches: the cached row
    assert calls == [1]


@pytest.mark.parametrize("model_type", sorted(FALLBACK))
def test_family_that_is_not_exact_natively_falls_back_to_adapters_and_says_why(model_type):
    kwargs, reason = FALLBACK[model_type]
    inference.clear_cache()
    if model_type == "opt":  # pre-norm OPT goes native: the cache must tell its post-norm config apart
        assert resolve_family(tiny("opt", **NATIVE["opt"][0]))[0].fallback_reason == ""
    model = tiny(model_type, **kwargs)
    before = logits(model, IDS)
    with pytest.warns(UserWarning, match=rf"not in hf_depthgrow's family table.*Only adapter blocks.*{reason}"):
        spec = resolve_family(model)[0]
    assert spec.inferred and reason in spec.fallback_reason
    state, config_json = copy.deepcopy(model.state_dict()), model.config.to_json_string()
    with pytest.raises(ValueError, match=rf"not function-preserving for {model_type} \(inferred.*{reason}"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warning, checked above
        grow_depth(model, [2], block="native")
    assert model.config.to_json_string() == config_json and growth_record(model) is None
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with pytest.warns(UserWarning, match=reason):
        grow_depth(model, [0, 2, 4])
    assert growth_record(model).block_kinds == ("adapter",)
    assert max_diff(logits(model, IDS), before) <= TOL


def test_probe_on_a_fused_expert_bank_takes_exactly_the_zeroed_parameters():
    from hf_depthgrow.probe.signal import probe
    from hf_depthgrow.probe.stepping_stone import stepping_stone

    kwargs, _ = NATIVE["mixtral"]
    model = tiny("mixtral", **kwargs)
    batches = [{"input_ids": IDS, "labels": IDS.clone()} for _ in range(3)]
    result = probe(model, batches, positions=[2], keep_gradients=True, progress=False)
    grown = grow_depth(copy.deepcopy(model), [2])
    zeroed = {name.split("layers.2.", 1)[1] for name, p in grown.named_parameters() if "layers.2." in name and not p.any()}
    # The bank's gate_up_proj is not a zeroed parameter (its gradient at zero init is 0): the probe leaves it out.
    assert set(result.gradients[0]) == zeroed and not any("gate_up" in n for n in zeroed)
    stone, info = stepping_stone(model, 2, batches, gradient=result.gradients[0])
    assert info.loss_stone <= info.loss_old
