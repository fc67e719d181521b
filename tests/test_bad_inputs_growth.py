"""Bad input to `grow_depth`, `GrowthConfig` and `bypass_new_blocks`: one clear error, the model untouched."""

import copy
import warnings

import peft
import pytest
import torch
import transformers
from torch import nn

from hf_depthgrow import SUPPORTED_FAMILIES, GrowthConfig, bypass_new_blocks, grow_depth, growth_record
from hf_depthgrow.growth.record import InvalidGrowthRecordError
from hf_depthgrow.growth.verify import GrowthNotExactError
from hf_depthgrow.testing import tiny_model

OUT_OF_RANGE = "position {k} is out of range: the model has 4 layers, so 0 <= k <= 4."
NOT_INT = "positions must be ints, got {v!r} ({t})"
EPS_POSITIVE = "eps must be > 0, got {v}: a norm without epsilon is singular at z = 0 (docs/theory.md §6)."
EPS_FINITE = "eps must be a finite positive number or None, got {v!r}"
DIM = "adapter_dim must be a positive int or None, got {v!r}"
ZERO_IN = (
    "eps={v:g} rounds to 0 in {dtype} (smallest positive value {tiny:g}): a norm with eps 0 is singular at z = 0. "
    "Pass a larger eps with block='adapter', or grow the model in float32."
)

# (case id, positions, kwargs, message)
CONFIG_CASES = [
    ("position too high", [5], {}, OUT_OF_RANGE.format(k=5)),
    ("position negative", [-1], {}, OUT_OF_RANGE.format(k=-1)),
    ("position bool", [True], {}, NOT_INT.format(v=True, t="bool")),
    ("position float", [1.5], {}, NOT_INT.format(v=1.5, t="float")),
    ("position string", ["2"], {}, NOT_INT.format(v="2", t="str")),
    ("positions empty", [], {}, "positions is empty: give at least one insertion point k (0 <= k <= number of layers)."),
    ("positions an int", 3, {}, "positions must be a list of ints, got 3"),
    ("positions a string", "12", {}, "positions must be a list of ints, got '12'"),
    ("unknown block", [1], {"block": "nope"}, "block must be one of ('auto', 'native', 'adapter'), got 'nope'"),
    ("block not a string", [1], {"block": ["native"]}, "block must be one of ('auto', 'native', 'adapter'), got ['native']"),
    ("unknown init", [1], {"init": "zeros"}, "init must be one of ('copy', 'random'), got 'zeros'"),
    ("unknown act", [1], {"adapter_act": "swish"}, "adapter_act must be one of ['gelu', 'relu', 'silu', 'tanh'], got 'swish'"),
    ("act unhashable", [1], {"adapter_act": ["gelu"]}, "adapter_act must be one of ['gelu', 'relu', 'silu', 'tanh'], got ['gelu']"),
    ("eps zero", [1], {"eps": 0.0}, EPS_POSITIVE.format(v=0.0)),
    ("eps negative", [1], {"eps": -1e-6}, EPS_POSITIVE.format(v=-1e-6)),
    ("eps nan", [1], {"eps": float("nan")}, EPS_FINITE.format(v=float("nan"))),
    ("eps inf", [1], {"eps": float("inf")}, EPS_FINITE.format(v=float("inf"))),
    ("eps bool", [1], {"eps": True}, EPS_FINITE.format(v=True)),
    ("adapter_dim bool", [1], {"adapter_dim": True}, DIM.format(v=True)),
    ("adapter_dim zero", [1], {"adapter_dim": 0}, DIM.format(v=0)),
    ("adapter_dim float", [1], {"adapter_dim": 2.5}, DIM.format(v=2.5)),
    ("seed bool", [1], {"seed": True}, "seed must be an int, got True"),
    ("seed float", [1], {"seed": 1.0}, "seed must be an int, got 1.0"),
    ("verify not bool", [1], {"verify": "yes"}, "verify must be True or False, got 'yes'"),
    (
        "native eps differs",
        [1],
        {"block": "native", "eps": 1e-3},
        "native blocks use the family's norms with the config's eps (1e-06); a different eps (0.001) would not survive "
        "save/load. Use block='adapter' for a block with its own eps.",
    ),
]


def same(a, b):
    # State dicts of quantised models also hold dtypes and tuples of packed tensors.
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and (a.dequantize() if a.is_quantized else a).equal(b.dequantize() if b.is_quantized else b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def fingerprint(model):
    return (
        copy.deepcopy(model.state_dict()),
        model.config.to_json_string(),
        [(id(m), m.training) for m in model.modules()],
    )


def assert_unchanged(model, before):
    state, config_json, modules = before
    now = model.state_dict()
    assert now.keys() == state.keys() and all(same(now[k], state[k]) for k in state)
    assert model.config.to_json_string() == config_json
    assert [(id(m), m.training) for m in model.modules()] == modules
    assert getattr(model.config, "depth_growth", None) is None


def refused(model, error, message, positions, **kwargs):
    before = fingerprint(model)
    with pytest.raises(error) as caught:
        grow_depth(model, positions, **kwargs)
    assert type(caught.value) is error
    assert str(caught.value) == message
    assert_unchanged(model, before)
    return caught.value


@pytest.mark.parametrize("positions, kwargs, message", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_argument_is_refused_and_model_untouched(positions, kwargs, message):
    refused(tiny_model("llama"), ValueError, message, positions, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"adapter_dim": True}, DIM.format(v=True)), ({"eps": float("inf")}, EPS_FINITE.format(v=float("inf")))],
)
def test_growth_config_refuses_on_its_own(kwargs, message):
    with pytest.raises(ValueError) as caught:
        GrowthConfig(**kwargs)
    assert type(caught.value) is ValueError and str(caught.value) == message


@pytest.mark.parametrize(
    "dtype, eps, block",
    [(torch.float16, 1e-8, "adapter"), (torch.float16, 1e-30, "adapter"), (torch.bfloat16, 1e-46, "adapter")],
)
def test_eps_that_rounds_to_zero_in_the_model_dtype_is_refused(dtype, eps, block):
    finfo = torch.finfo(dtype)
    message = ZERO_IN.format(v=eps, dtype=dtype, tiny=finfo.smallest_normal * finfo.eps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before the "cannot resolve" warning
        refused(tiny_model("llama").to(dtype), ValueError, message, [1], block=block, eps=eps)


def test_model_eps_is_checked_where_its_norms_compute_it():
    # The model's own eps (1e-8) is 0 in float16 but its norms compute in float32: inherited, it is accepted;
    # the same eps passed explicitly for a new adapter block is refused.
    model = tiny_model("llama", rms_norm_eps=1e-8).to(torch.float16)
    grow_depth(model, [1], block="native")
    assert growth_record(model).native_indices == (1,)
    message = ZERO_IN.format(v=1e-8, dtype=torch.float16, tiny=5.960464477539063e-08)
    refused(tiny_model("llama").to(torch.float16), ValueError, message, [1], block="adapter", eps=1e-8)


def _lora(model):
    config = peft.LoraConfig(target_modules=["o_proj", "down_proj"], init_lora_weights=False)
    return peft.inject_adapter_in_model(config, model)


def test_peft_wrapped_residual_output_is_refused_for_native_blocks():
    message = (
        "cannot zero the residual output `layer 1: self_attn.o_proj`: it is a peft.tuners.lora.layer.Linear (a wrapper or "
        "quantised layer), so a native block copied from it would not start as the identity. Merge or remove the "
        "wrapper first (peft: merge_and_unload()), or use block='adapter'."
    )
    refused(_lora(tiny_model("llama")), ValueError, message, [2], block="native")


def test_peft_model_wrapper_is_refused():
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(target_modules=["o_proj"]))
    message = (
        "the model is a peft PeftModel: grow the transformers model before wrapping it with peft, or merge the "
        "adapters first (model.merge_and_unload())."
    )
    refused(model, ValueError, message, [2])


def test_torch_quantised_model_is_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices
        model = torch.ao.quantization.quantize_dynamic(tiny_model("llama"), {nn.Linear}, dtype=torch.qint8)
    cls = "torch.ao.nn.quantized.dynamic.modules.linear.Linear"
    message = (
        f"module `model.layers.0.self_attn.q_proj` is a torch quantised {cls}: the model cannot be grown or trained "
        "exactly; grow the float model and quantise afterwards."
    )
    for block in ("native", "adapter"):
        refused(model, ValueError, message, [2], block=block)


def test_flagged_quantised_model_is_refused():
    model = tiny_model("llama")
    model.config.quantization_config = {"quant_method": "gguf"}
    message = (
        "the model is flagged as quantised (e.g. loaded with gguf_file= or a quantization_config) and cannot be grown "
        "or trained: make a float copy first (see hf_depthgrow.data.embedded for the GGUF case), or load the base with "
        "bitsandbytes (load_model(..., quantize='4bit' or '8bit'))."
    )
    refused(model, ValueError, message, [1])


def test_post_norm_native_is_refused():
    message = "native blocks are not function-preserving for bert: it is post-norm (LN(z + 0) != z). Use block='adapter' or 'auto'."
    refused(tiny_model("bert"), ValueError, message, [1], block="native")


def test_model_without_a_layer_stack_is_refused():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.PretrainedConfig()
            self.linear = nn.Linear(4, 4)

    message = f"Cannot find a layer stack in Flat (model_type ''). Supported families: {', '.join(SUPPORTED_FAMILIES)}."
    refused(Flat(), ValueError, message, [0])


def test_a_growth_that_is_not_exact_is_rolled_back():
    model = tiny_model("llama")
    # A hook on a residual output: zeroing the projection's weights no longer silences it.
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, out: out + 1.0)
    before = fingerprint(model)
    with pytest.raises(GrowthNotExactError, match=r"^the grown model is not exact: max \|diff\| \S+ > tolerance 1e-05 "
                       r"\(torch\.float32\) on a probe input, so the growth was rolled back\.") as caught:
        grow_depth(model, [2], block="native")
    assert type(caught.value) is GrowthNotExactError and isinstance(caught.value, ValueError)
    assert_unchanged(model, before)
    grow_depth(model, [2], block="native", verify=False)  # the opt-out grows it anyway
    assert model.config.num_hidden_layers == 5


def test_bypass_refuses_a_forged_record_and_leaves_the_model():
    model = tiny_model("llama")
    model.config.depth_growth = {"base_num_layers": 4, "num_layers": 5, "native_indices": [7]}
    state, config_json = copy.deepcopy(model.state_dict()), model.config.to_json_string()
    with pytest.raises(InvalidGrowthRecordError) as caught:
        with bypass_new_blocks(model):
            pass
    assert str(caught.value) == "growth record: native_indices entries must be an integer in 0..4, got 7"
    assert model.config.to_json_string() == config_json
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model.config.depth_growth["native_indices"] == [7]  # bypass never rewrites the stored record
