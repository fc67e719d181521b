"""The flagship: a grown model at init computes exactly what the original did, for every family."""

import copy
import math
import warnings

import pytest
import torch
import transformers
from torch import nn

from hf_depthgrow import (
    GrowthConfig,
    build_block,
    bypass_new_blocks,
    grow_depth,
    growth_record,
    new_block_modules,
    new_block_parameters,
    norm_inventory,
)
from hf_depthgrow.growth.families import FAMILIES
from hf_depthgrow.growth.towers import resolve_family
from hf_depthgrow.testing import DECODERS, SLIDING, SLIDING_WINDOW, TINY, model_output, tiny_inputs, tiny_model

TOL = 1e-6
ALL = sorted(TINY)
POSITION_SETS = [[0], [2], [4], [0, 2, 4], [3, 3]]


def max_diff(a, b):
    return (a - b).abs().max().item()


def perturb_new_blocks(model, scale=0.05, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in new_block_parameters(model):
            param.add_(scale * torch.randn(param.shape, generator=generator))


@pytest.mark.parametrize("model_type", ALL)
@pytest.mark.parametrize("block", ["auto", "adapter"])
def test_grown_model_is_exact(model_type, block):
    model = tiny_model(model_type)
    inputs = tiny_inputs(model)
    before = model_output(model, inputs)
    for positions in POSITION_SETS:
        grown = grow_depth(copy.deepcopy(model), positions, block=block)
        assert max_diff(model_output(grown, inputs), before) <= TOL, (model_type, block, positions)
        # The new blocks are real: moving their zeroed weights moves the output.
        perturb_new_blocks(grown)
        assert max_diff(model_output(grown, inputs), before) > 1e-4, (model_type, block, positions)


@pytest.mark.parametrize("model_type", [m for m in ALL if FAMILIES[m].norm_style == "pre"])
def test_native_random_init_is_exact_and_seeded(model_type):
    model = tiny_model(model_type)
    inputs = tiny_inputs(model)
    before = model_output(model, inputs)
    a = grow_depth(copy.deepcopy(model), [1, 3], block="native", init="random", seed=7)
    b = grow_depth(copy.deepcopy(model), [1, 3], block="native", init="random", seed=7)
    c = grow_depth(copy.deepcopy(model), [1, 3], block="native", init="random", seed=8)
    assert max_diff(model_output(a, inputs), before) <= TOL
    pa, pb, pc = (dict(new_block_parameters(m)) for m in (a, b, c))
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    assert any(not torch.equal(pa[k], pc[k]) for k in pa)


def test_native_blocks_are_copies_with_zeroed_outputs():
    model = tiny_model("llama")
    source = copy.deepcopy(model.model.layers[1])
    grow_depth(model, [2], block="native", init="copy")
    new = model.model.layers[2]
    assert new is not model.model.layers[1]
    assert torch.equal(new.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
    assert torch.equal(new.mlp.up_proj.weight, source.mlp.up_proj.weight)
    assert new.self_attn.o_proj.weight.abs().max() == 0 and new.mlp.down_proj.weight.abs().max() == 0
    # The first-order signal needs the rest non-zero (docs/theory.md §1: zero only the last projections).
    assert new.self_attn.v_proj.weight.abs().max() > 0


def test_block_for_a_position_does_not_depend_on_other_positions():
    model = tiny_model("bert")
    alone = grow_depth(copy.deepcopy(model), [2], block="adapter", seed=3)
    together = grow_depth(copy.deepcopy(model), [0, 2, 4], block="adapter", seed=3)
    w_alone = new_block_modules(alone)[0].w_in.weight
    w_together = [m for m in new_block_modules(together) if m is together.bert.encoder.layer[2].depthgrow_pre[0]][0].w_in.weight
    assert torch.equal(w_alone, w_together)
    _, standalone = build_block(model, 2, GrowthConfig(block="adapter", seed=3))
    assert torch.equal(standalone.w_in.weight, w_alone)


@pytest.mark.parametrize("model_type", DECODERS)
@pytest.mark.parametrize("block", ["auto", "adapter"])
def test_generation_with_cache_matches(model_type, block):
    model = tiny_model(model_type)
    prompt = tiny_inputs(model, batch=1, seq=8, seed=1)["input_ids"]
    new_tokens = 2 * SLIDING_WINDOW  # prompt + continuation well past the sliding window

    def greedy(m, use_cache):
        out = m.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=use_cache,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        return out.sequences, torch.stack(out.logits)

    ref_seq, ref_scores = greedy(model, True)
    grown = grow_depth(copy.deepcopy(model), [0, 2, 4], block=block)
    for use_cache in (True, False):
        seq, scores = greedy(grown, use_cache)
        assert torch.equal(seq, ref_seq), (model_type, use_cache)
        assert max_diff(scores, ref_scores) <= 1e-5
    # Sanity: the cache matters for these models (sliding windows are exercised), i.e. a grown
    # model with perturbed blocks decodes the same with and without cache.
    perturb_new_blocks(grown)
    seq_c, scores_c = greedy(grown, True)
    seq_n, scores_n = greedy(grown, False)
    assert torch.equal(seq_c, seq_n) and max_diff(scores_c, scores_n) <= 1e-4


@pytest.mark.parametrize("model_type", SLIDING)
def test_sliding_window_is_active_in_tiny_models(model_type):
    """The window is short enough that the generation test exercises it: logits change without it."""
    model = tiny_model(model_type)
    inputs = tiny_inputs(model, batch=1, seq=4 * SLIDING_WINDOW)
    wide = tiny_model(model_type, sliding_window=10 * SLIDING_WINDOW)
    wide.load_state_dict(model.state_dict())
    assert max_diff(model_output(model, inputs), model_output(wide, inputs)) > 1e-4


def test_layer_types_and_layer_idx_fixed_up():
    model = tiny_model("gemma3_text")
    original = list(model.config.layer_types)
    grow_depth(model, [1, 4], block="native")
    layers = model.model.layers
    assert model.config.num_hidden_layers == len(layers) == 6
    # Each original layer keeps its own entry; a new block takes the entry of its copy source.
    assert model.config.layer_types == [original[0], original[0], original[1], original[2], original[3], original[3]]
    for i, layer in enumerate(layers):
        assert layer.self_attn.layer_idx == i
        assert layer.self_attn.layer_type == model.config.layer_types[i]
    # A freshly initialised block is built for its slot's attention type too.
    grow_depth(model, [2], block="native", init="random")
    assert model.model.layers[2].self_attn.layer_type == model.config.layer_types[2] == original[0]


def test_tied_embeddings_stay_tied(tmp_path):
    model = tiny_model("llama", tie_word_embeddings=True)
    grow_depth(model, [2], block="native")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_growth_record_contents():
    model = tiny_model("llama")
    grow_depth(model, [0, 4], block="native", init="copy")
    record = growth_record(model)
    assert record.base_num_layers == 4 and record.num_layers == 6
    assert record.native_indices == (0, 5) and record.old_indices == (1, 2, 3, 4)
    assert record.history[0].block == "native" and record.history[0].init == "copy"
    assert record.history[0].eps == model.config.rms_norm_eps
    assert record.hf_depthgrow_version
    # Stored as a plain dict in the config (it travels in config.json).
    assert model.config.depth_growth["native_indices"] == [0, 5]
    # Growing again shifts the earlier indices; adapters are listed by host layer.
    grow_depth(model, [1], block="native")
    assert growth_record(model).native_indices == (0, 1, 6)
    grow_depth(model, [3], block="adapter", eps=1e-5)
    adapters = growth_record(model).to_dict()["adapters"]
    assert adapters == [{"host": 3, "where": "pre", "dim": 32, "norm": "rms", "eps": 1e-5, "act": "gelu"}]
    assert growth_record(model).base_num_layers == 4


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2", "bert", "vit"])
def test_bypass_runs_the_original(model_type):
    model = tiny_model(model_type)
    inputs = tiny_inputs(model)
    before = model_output(model, inputs)
    n_params = sum(p.numel() for p in model.parameters())
    grow_depth(model, [1, 3], block="auto")
    grow_depth(model, [2], block="adapter")
    perturb_new_blocks(model)
    after = model_output(model, inputs)
    assert max_diff(after, before) > 1e-4
    with bypass_new_blocks(model) as same:
        assert same is model
        assert max_diff(model_output(model, inputs), before) <= TOL
        assert model.config.num_hidden_layers == 4
        # No second copy of the weights: the model's parameters are the grown model's.
        assert sum(p.numel() for p in model.parameters()) > n_params
    assert max_diff(model_output(model, inputs), after) <= TOL
    assert model.config.num_hidden_layers == growth_record(model).num_layers


def test_bypass_restores_on_error():
    model = tiny_model("gemma3_text")
    grow_depth(model, [2], block="native")
    types = list(model.config.layer_types)
    with pytest.raises(RuntimeError):
        with bypass_new_blocks(model):
            raise RuntimeError("boom")
    assert model.config.layer_types == types and len(model.model.layers) == 5


def test_gpt2_inverse_layer_scaling_falls_back_to_adapter():
    model = tiny_model("gpt2", scale_attn_by_inverse_layer_idx=True)
    inputs = tiny_inputs(model)
    before = model_output(model, inputs)
    grow_depth(model, [2])
    assert growth_record(model).history[0].block == "adapter"
    assert max_diff(model_output(model, inputs), before) <= TOL
    with pytest.raises(ValueError, match="ties the maths to layer indices"):
        grow_depth(tiny_model("gpt2", scale_attn_by_inverse_layer_idx=True), [2], block="native")


# ----------------------------------------------------------------------------- bad input


def _fingerprint(model):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        model.config.to_json_string(),
        [id(m) for m in resolve_family(model)[1]],
    )


def _assert_unchanged(model, fingerprint):
    state, config_json, layer_ids = fingerprint
    now = model.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in state)
    assert model.config.to_json_string() == config_json
    assert [id(m) for m in resolve_family(model)[1]] == layer_ids
    assert growth_record(model) is None


@pytest.mark.parametrize(
    "positions, kwargs, message",
    [
        ([5], {}, "out of range"),
        ([-1], {}, "out of range"),
        ([1.5], {}, "must be ints"),
        (["2"], {}, "must be ints"),
        ([True], {}, "must be ints"),
        ([], {}, "positions is empty"),
        (3, {}, "list of ints"),
        ([1], {"eps": 0.0}, "eps must be > 0"),
        ([1], {"eps": -1e-6}, "eps must be > 0"),
        ([1], {"block": "nope"}, "block must be one of"),
        ([1], {"init": "zeros"}, "init must be one of"),
        ([1], {"block": "native", "eps": 1e-3}, "would\nnot survive|not survive"),
    ],
)
def test_bad_input_leaves_model_unmodified(positions, kwargs, message):
    model = tiny_model("llama")
    fingerprint = _fingerprint(model)
    with pytest.raises(ValueError, match=message):
        grow_depth(model, positions, **kwargs)
    _assert_unchanged(model, fingerprint)


def test_post_norm_native_is_refused():
    model = tiny_model("bert")
    fingerprint = _fingerprint(model)
    with pytest.raises(ValueError, match="post-norm"):
        grow_depth(model, [1], block="native")
    _assert_unchanged(model, fingerprint)


def test_quantised_model_is_refused():
    model = tiny_model("llama")
    model.config.quantization_config = {"quant_method": "gguf"}
    with pytest.raises(ValueError, match="quantised"):
        grow_depth(model, [1])
    assert model.config.num_hidden_layers == 4 and growth_record(model) is None


def test_no_layer_stack_is_a_clear_error():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.PretrainedConfig()
            self.linear = nn.Linear(4, 4)

    with pytest.raises(ValueError, match="Cannot find a layer stack.*Supported families: .*llama"):
        grow_depth(Flat(), [0])


def test_failure_midway_rolls_back(monkeypatch):
    model = tiny_model("qwen2")
    fingerprint = _fingerprint(model)
    import hf_depthgrow.growth.engine as growth

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(growth, "_update_record", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        grow_depth(model, [1, 2], block="native")
    _assert_unchanged(model, fingerprint)
    fingerprint = _fingerprint(model)
    with pytest.raises(RuntimeError, match="disk on fire"):
        grow_depth(model, [1, 4], block="adapter")
    _assert_unchanged(model, fingerprint)
    assert not new_block_modules(model)


def test_unknown_family_gets_adapters_with_a_warning():
    model = tiny_model("llama")
    model.config.model_type = "my_llama_fork"
    inputs = tiny_inputs(model)
    before = model_output(model, inputs)
    with pytest.warns(UserWarning, match="not in hf_depthgrow's family table"):
        grow_depth(model, [2])
    assert growth_record(model).history[0].block == "adapter"
    assert max_diff(model_output(model, inputs), before) <= TOL


# ----------------------------------------------------------------------------- norms


def test_norm_inventory_gemma_offset_and_bounds():
    model = tiny_model("gemma")
    rows = norm_inventory(model)
    names = {r.name for r in rows}
    assert "model.norm" in names and "model.layers.0.input_layernorm" in names
    row = next(r for r in rows if r.name == "model.layers.0.input_layernorm")
    weight = model.model.layers[0].input_layernorm.weight
    assert row.gamma_offset == 1.0
    assert math.isclose(row.max_gamma, float((weight.detach() + 1).abs().max()), rel_tol=1e-6)
    assert math.isclose(row.lipschitz_bound, row.max_gamma / math.sqrt(row.eps), rel_tol=1e-9)
    llama_row = norm_inventory(tiny_model("llama"))[0]
    assert llama_row.gamma_offset == 0.0


def test_norm_inventory_sees_adapter_norms_without_offset():
    model = tiny_model("gemma")
    grow_depth(model, [1], block="adapter", eps=1e-5)
    row = next(r for r in norm_inventory(model) if "depthgrow_pre" in r.name)
    assert row.eps == 1e-5 and row.gamma_offset == 0.0 and math.isclose(row.max_gamma, 1.0)


def test_eps_below_dtype_resolution_warns():
    # 1e-6 is subnormal in float16 (non-zero, so accepted with a warning); 1e-8 rounds to 0 and is refused
    # (tests/test_bad_inputs_growth.py).
    model = tiny_model("llama").to(torch.float16)
    with pytest.warns(UserWarning, match="cannot resolve"):
        grow_depth(model, [1], block="adapter", eps=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grow_depth(tiny_model("llama"), [1], block="adapter", eps=1e-8)  # fine in fp32


def test_eps_warning_points_at_the_caller():
    model = tiny_model("llama").to(torch.float16)
    with pytest.warns(UserWarning, match="cannot resolve") as caught:
        grow_depth(model, [1], block="adapter", eps=1e-6)
    assert [w.filename for w in caught] == [__file__]


# ----------------------------------------------------------------------------- layout of the package


def test_each_public_name_is_exported_by_its_own_module_and_the_package_exports_its_all():
    import hf_depthgrow.growth as growth_pkg
    import hf_depthgrow.growth.engine as engine

    # engine exports what it defines, nothing re-exported from the modules beside it.
    assert all(getattr(engine, name).__module__ == engine.__name__ for name in engine.__all__)
    assert {"grow_depth", "new_block_modules", "new_block_parameters", "reattach_adapters"} <= set(engine.__all__)
    for name in growth_pkg.__all__:
        assert getattr(growth_pkg, name) is not None, name
    for name in ("GrowthRecord", "growth_record", "InvalidGrowthRecordError", "bypass_new_blocks", "GrowthConfig"):
        assert name in growth_pkg.__all__
    assert growth_pkg.grow_depth is engine.grow_depth and not hasattr(engine, "bypass_new_blocks")


def test_adapter_detach_is_the_inverse_of_attach():
    from hf_depthgrow.growth import adapter

    layer = nn.Linear(8, 8)
    block = adapter.NormalizedResidualBlock(8, 4)
    adapter.attach(layer, block, "pre")
    assert adapter.hosted_blocks(layer)["pre"] == [block]
    assert adapter.detach(layer, block) is True
    assert adapter.hosted_blocks(layer) == {"pre": [], "post": []}
    assert adapter.detach(layer, block) is False
    z = torch.randn(2, 8)
    assert torch.equal(layer(z), nn.functional.linear(z, layer.weight, layer.bias))


# ----------------------------------------------------------------------------- reliability


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("kwargs", [dict(block="native", init="random"), dict(block="native", init="copy"), dict(block="adapter")])
def test_new_blocks_follow_the_model_mode(training, kwargs):
    model = tiny_model("llama").train(training)
    model.model.layers[1].train(True)  # a copy source in train mode must not leak its mode either
    grow_depth(model, [0, 2], **kwargs)
    assert all(m.training == training for block in new_block_modules(model) for m in block.modules())


def test_reattached_adapters_follow_the_model_mode():
    from hf_depthgrow.growth.engine import reattach_adapters

    grown = grow_depth(tiny_model("llama"), [1], block="adapter")
    base = tiny_model("llama").eval()
    blocks = reattach_adapters(base, growth_record(grown))
    assert blocks and not any(m.training for b in blocks for m in b.modules())


def test_exactness_check_leaves_rng_modes_and_cache_setting_alone():
    model = tiny_model("llama").train()
    model.model.layers[3].eval()  # a mixed state must come back as it was, not as model.train()
    modes = [m.training for m in model.modules()]
    use_cache = model.config.use_cache
    torch.manual_seed(123)
    state = torch.get_rng_state()
    grow_depth(model, [2], block="native")
    assert torch.equal(torch.get_rng_state(), state)
    assert model.config.use_cache == use_cache
    new = {id(m) for b in new_block_modules(model) for m in b.modules()}
    assert [m.training for m in model.modules() if id(m) not in new] == modes


def test_exactness_check_can_be_skipped_and_is_not_recorded(monkeypatch):
    import hf_depthgrow.growth.verify as verify

    calls = []
    monkeypatch.setattr(verify, "run_probe", lambda model, inputs: calls.append(1) or torch.zeros(1))
    grow_depth(tiny_model("llama"), [2], verify=False)
    assert calls == []
    model = grow_depth(tiny_model("llama"), [2])
    assert calls == [1, 1]
    assert "verify" not in growth_record(model).history[0].config


def test_exactness_check_fails_a_nan_model_and_a_growth_that_adds_nan():
    # NaN > tol is false, so a NaN output once passed the check and a broken model was grown and saved
    # without a word: a non-finite output before growing is refused, naming the parameter.
    import math

    from hf_depthgrow.growth.verify import GrowthNotExactError

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.fill_(math.nan)
    message = r"not finite \(1 parameter\(s\) hold NaN or inf, e.g. model.layers.3.mlp.down_proj.weight\): a broken model is not grown"
    with pytest.raises(GrowthNotExactError, match=message):
        grow_depth(model, [1])
    assert growth_record(model) is None and len(model.model.layers) == 4
    clean = tiny_model("llama")
    handle = clean.model.layers[0].register_forward_hook(lambda m, a, out: out * math.nan if len(clean.model.layers) > 4 else out)
    with pytest.raises(GrowthNotExactError, match="not exact: max \\|diff\\| nan"):
        grow_depth(clean, [1])
    handle.remove()
    assert growth_record(clean) is None
