"""Route A/B block terms on mixture-of-experts families: `B_W` over exactly the residual outputs, `B_a` per routed expert.

`hf_depthgrow.testing.tiny_model` builds only the table's (dense) families, so the MoE families are
built tiny here from their transformers config classes, as `test_family_inference.py` does; their
rows are inferred (`mlp.experts.down_proj` names a parameter of a fused expert bank). Each model is
grown with one native block whose residual outputs are then set to small random values.
"""

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_depthgrow import FAMILIES, grow_depth, new_block_parameters
from hf_depthgrow.evaluation import block_norm_terms, evaluate_delta, route_inputs
from hf_depthgrow.growth.families import FamilySpec, residual_output_targets
from hf_depthgrow.growth.towers import resolve_family
from hf_depthgrow.testing import tiny_inputs, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:loss_bound not given")

_BASE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_key_value_heads=2, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
_DEEPSEEK = dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=8,
                 qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1)
# mixtral: expert width 64 > hidden 32; qwen2_moe: a gated shared expert; deepseek_v3: routing weights scaled by 2.5;
# gpt_oss: down projections stored transposed, with biases.
MOE = {
    "mixtral": {},
    "qwen2_moe": dict(shared_expert_intermediate_size=32),
    "qwen3_moe": {},
    "olmoe": {},
    "deepseek_v3": _DEEPSEEK,
    "gpt_oss": dict(head_dim=8, layer_types=["full_attention"] * 4),
}


def tiny_moe(model_type, **kwargs):
    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type](**{**_BASE, **_MOE, **MOE.get(model_type, {}), **kwargs})
    return AutoModelForCausalLM.from_config(config).eval()


def grown_with_outputs(model, seed=0, scale=0.05):
    """`grow_depth(model, [1])` with the new block's residual outputs (zero after growth) set to small random values."""
    grown = grow_depth(model, [1])
    spec, stack, _ = resolve_family(grown)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, params in residual_output_targets(spec, stack[1]):
            for p in params:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return grown, stack[1], residual_output_targets(spec, stack[1])


def rows(model, n=5, seq=7, seed=1):
    batch = tiny_inputs(model, batch=n, seq=seq, seed=seed)
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def hand_b_w(targets):
    return sum(p.detach().double().pow(2).sum() for _, _, params in targets for p in params).sqrt().item()


def hand_b_a(grown, block, examples):
    """`max_i ||A_i||_F` written out: each projection's input, and per routed (token, expert) the expert's
    down-projection input (gate/up and gating recomputed from the bank's weights) times the routing weight."""
    norms = []
    for row in examples:
        sq, handles = [], []
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear) and name.endswith(("o_proj", "down_proj")):
                handles.append(module.register_forward_pre_hook(
                    lambda m, args: sq.append(args[0].double().pow(2).sum() + (m.bias is not None) * args[0][..., 0].numel())))
        bank = block.mlp.experts

        def routed(m, args):
            x, index, weights = (a.double() for a in args[:3])
            for t in range(x.shape[0]):
                for e, w in zip(index[t].long().tolist(), weights[t]):
                    if getattr(m, "is_transposed", False):
                        a = m._apply_gate(x[t] @ m.gate_up_proj[e].double() + m.gate_up_proj_bias[e].double())
                    else:
                        gate, up = (x[t] @ m.gate_up_proj[e].double().T).chunk(2)
                        a = m.act_fn(gate) * up
                    sq.append((w * a).pow(2).sum() + (w.pow(2) if hasattr(m, "down_proj_bias") else 0))

        handles.append(bank.register_forward_pre_hook(routed))
        with torch.no_grad():
            grown(input_ids=row["input_ids"][None])
        for h in handles:
            h.remove()
        norms.append(float(sum(sq)) ** 0.5)
    return max(norms)


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_b_w_and_b_a_match_a_hand_computation(model_type):
    grown, block, targets = grown_with_outputs(tiny_moe(model_type))
    entries = [e for e, _, _ in targets]
    assert any(e.endswith("experts.down_proj") for e in entries)
    bank = block.mlp.experts
    assert bank.gate_up_proj.abs().max() > 0  # the bank's other weights must stay out of B_W
    examples = rows(grown)
    terms = block_norm_terms(grown, examples, batch_size=2)
    assert terms["b_w"] == pytest.approx(hand_b_w(targets), rel=1e-9)
    assert terms["b_a"] == pytest.approx(hand_b_a(grown, block, examples), rel=1e-5)
    assert terms["rho"] > 0 and "routing weight" in terms["b_a_how"]


def test_expert_bank_is_measured_the_same_under_every_experts_implementation():
    grown, _, _ = grown_with_outputs(tiny_moe("qwen3_moe"))
    examples = rows(grown)
    seen = {}
    bank = resolve_family(grown)[1][1].mlp.experts
    for impl in ("eager", "batched_mm", "grouped_mm"):
        grown.set_experts_implementation(impl)
        bank.config._experts_implementation = impl  # the new block is a deep copy, with its own config
        seen[impl] = block_norm_terms(grown, examples, batch_size=3)["b_a"]
    assert seen["batched_mm"] == pytest.approx(seen["eager"], rel=1e-5)
    assert seen["grouped_mm"] == pytest.approx(seen["eager"], rel=1e-5)


def test_masked_tokens_are_left_out_of_b_a_for_flattened_moe_tokens():
    grown, _, _ = grown_with_outputs(tiny_moe("mixtral"))
    first, second = rows(grown, n=2, seq=9)
    masked = {**first, "attention_mask": torch.tensor([1] * 6 + [0] * 3)}
    truncated = {k: v[:6] for k, v in first.items()}  # causal: the masked tail changes nothing before it
    alone = block_norm_terms(grown, [truncated], batch_size=1)["b_a"]
    assert block_norm_terms(grown, [masked], batch_size=1)["b_a"] == pytest.approx(alone, rel=1e-6)
    other = block_norm_terms(grown, [second], batch_size=1)["b_a"]
    assert block_norm_terms(grown, [masked, second], batch_size=2)["b_a"] == pytest.approx(max(alone, other), rel=1e-6)


def test_evaluate_delta_reports_route_terms_for_a_moe_model():
    base = tiny_moe("qwen2_moe")
    grown, _, targets = grown_with_outputs(copy.deepcopy(base))
    examples = rows(grown, n=6)
    inputs = route_inputs(grown, n_train=1000, delta_erm=0.01, stone_pop=0.1, stone=0.05, block_data=examples)
    assert inputs.b_w == pytest.approx(hand_b_w(targets), rel=1e-9) and inputs.b_a > 0 and inputs.rho > 0
    assert "routing weight" in inputs.sources["b_a"]
    res = evaluate_delta(grown, examples, loss_bound=10.0, n_bootstrap=50, routes=inputs, use_evaluate=False)
    assert res.routes["route_a"]["complete"] and res.routes["route_b"]["complete"]
    assert res.routes["terms"]["b_a"] == inputs.b_a and res.routes["terms"]["eps_M"] > 0


class ListExperts(nn.Module):
    """A fused expert bank rewritten as one MLP of `nn.Linear`s per expert (the older transformers layout), same call."""

    def __init__(self, fused):
        super().__init__()
        n, two_inter, hidden = fused.gate_up_proj.shape
        self.act_fn, self.experts = fused.act_fn, nn.ModuleList()
        for e in range(n):
            mlp = nn.Module()
            mlp.gate_up_proj = nn.Linear(hidden, two_inter, bias=False)
            mlp.down_proj = nn.Linear(two_inter // 2, hidden, bias=False)
            with torch.no_grad():
                mlp.gate_up_proj.weight.copy_(fused.gate_up_proj[e])
                mlp.down_proj.weight.copy_(fused.down_proj[e])
            self.experts.append(mlp)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, mlp in enumerate(self.experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                gate, up = mlp.gate_up_proj(hidden_states[token]).chunk(2, dim=-1)
                out.index_add_(0, token, mlp.down_proj(self.act_fn(gate) * up) * top_k_weights[token, slot, None])
        return out


def test_per_expert_linear_lists_give_b_w_and_say_why_b_a_is_unavailable(monkeypatch, tmp_path):
    from hf_depthgrow.evaluation import write_report

    model = tiny_moe("mixtral")
    for layer in model.model.layers:
        layer.mlp.experts = ListExperts(layer.mlp.experts)
    outputs = ("self_attn.o_proj", *(f"mlp.experts.experts.{e}.down_proj" for e in range(4)))
    monkeypatch.setitem(FAMILIES, "mixtral", FamilySpec("mixtral", layers="layers", kind="decoder", residual_outputs=outputs,
                                                        norm="rms", norm_style="pre", eps_key="rms_norm_eps"))
    grown, block, targets = grown_with_outputs(model)
    assert len(targets) == 5 and all(isinstance(m, nn.Linear) for _, m, _ in targets)
    examples = rows(grown, n=4)
    terms = block_norm_terms(grown, examples, batch_size=2)
    assert terms["b_w"] == pytest.approx(hand_b_w(targets), rel=1e-9) and terms["rho"] > 0
    assert terms["b_a"] is None and "cannot be attributed to examples" in terms["b_a_how"]

    inputs = route_inputs(grown, n_train=1000, delta_erm=0.01, stone_pop=0.1, stone=0.05, block_data=examples)
    assert inputs.b_a is None and inputs.sources["b_a"].startswith("not measured: `mlp.experts.experts.")
    res = evaluate_delta(grown, examples, loss_bound=10.0, n_bootstrap=50, routes=inputs, use_evaluate=False)
    for key in ("route_a", "route_b"):
        route = res.routes[key]
        assert not route["complete"] and route["missing"] == ["b_a"]
        assert "b_a: not measured" in route["sentence"] and "routed tokens" in route["sentence"]
    assert res.routes["terms"]["eps_M"] is None
    md = write_report(res, tmp_path, command="test")["markdown"].read_text()
    assert "not measured: `mlp.experts.experts." in md


def _perturbed_llama(block):
    grown = grow_depth(tiny_model("llama"), [1], block=block)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in new_block_parameters(grown):
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    batch = tiny_inputs(grown, batch=5, seq=9, seed=4)
    batch["attention_mask"][1, 6:] = 0
    return grown, [{k: v[i] for k, v in batch.items()} for i in range(5)]


# (rho, B_W, B_a) from the implementation before MoE support; bit-identical on the machine that recorded them.
DENSE_BEFORE = {
    "native": (1.0250277186390298, 2.7569108064185226, 3.8771015943934937),
    "adapter": (0.34160247513222936, 1.6154014279894133, 12.192016606769643),
}


@pytest.mark.parametrize("block", sorted(DENSE_BEFORE))
def test_dense_llama_terms_are_unchanged(block):
    grown, examples = _perturbed_llama(block)
    terms = block_norm_terms(grown, examples, batch_size=2)
    # fp32 forwards: another CPU may differ in the last bits, not more
    assert (terms["rho"], terms["b_w"], terms["b_a"]) == pytest.approx(DENSE_BEFORE[block], rel=1e-6)
