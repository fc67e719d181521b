"""The Route A/B inputs measured on models and data: block norms (`rho`, `B_W`, `B_a`) and stepping-stone margins.

`route_inputs` gathers every input of `hf_depthgrow.evaluation.routes.route_bounds`: it takes what
other modules computed (the trainer's `Delta_ERM`, the training-set size) and measures the rest
here. Data is read through the package's data contract (`hf_depthgrow.data.batches`).
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.func import functional_call

from ..data.batches import to_device
from ..growth.adapter import hosted_blocks
from ..growth.families import residual_output_targets
from ..growth.towers import resolve_family
from ..growth.prefix import lowest_new_index, prefix_hidden, start_at
from ..growth.record import growth_record
from ..growth.verify import TOLERANCES
from ..losses import example_losses, is_causal_lm, model_inputs
from .checks import prepare_batches, split_batch
from .paired import device_of, eval_mode, evaluate_delta, progress_bar
from .routes import RouteInputs

RHO_HOW = ("estimate: max over examples of ||d loss_i / d (block output)||_F (empirical Lipschitz of loss o f_top "
           "at the block's output, trained weights)")
B_A_HOW = ("max over examples of ||A_i||_F, A_i the activations that multiply the output weights over the example's tokens: "
           "a projection's input (plus 1 per token for a bias); for a fused expert bank, each routed expert's down-projection "
           "input times the token's routing weight (plus the weight for a bias)")
B_W_HOW = ("||W||_F of the trained block's residual-output parameters (weights and biases; of a fused expert bank, "
           "its down projections only)")


@dataclass
class BlockOutput:
    """One residual output of a new block: what `B_W` sums over and where `B_a` reads its activation.

    Args:
        name: Its `residual_outputs` entry (`"w_out"` for an adapter block).
        module: The projection, or the fused expert bank that holds the parameter.
        params: Exactly the parameters that write into the residual stream.
        bank: `True` for a parameter of a fused expert bank (`mlp.experts.down_proj`): what it multiplies is
            computed inside the bank, so it is read by replaying the bank (`_bank_activation`), not from its input.
    """

    name: str
    module: nn.Module
    params: list[nn.Parameter]
    bank: bool


def new_block_outputs(model: nn.Module) -> list[tuple[nn.Module, list[BlockOutput]]]:
    """Each new block with its residual outputs (its output weights W), as `residual_output_targets` names them."""
    record = growth_record(model)
    if not record:
        raise ValueError("the model has no growth record: there is no new block to measure")
    spec, stack, _ = resolve_family(model)
    out = []
    for i in record.native_indices:
        outputs = []
        for entry, module, params in residual_output_targets(spec, stack[i]):
            # A parameter entry holds no `weight` of a projection (same test as `zero_residual_outputs`).
            bank = bool(params) and not any(p is getattr(module, "weight", None) for p in params)
            outputs.append(BlockOutput(entry, module, params, bank))
        out.append((stack[i], outputs))
    for layer in stack:
        for hosted in hosted_blocks(layer).values():
            out.extend((block, [BlockOutput("w_out", block.w_out, list(block.w_out.parameters(recurse=False)), False)])
                       for block in hosted)
    return out


class _NotMeasurable(Exception):
    """Why the activation that multiplies an output weight cannot be read off reliably."""


def _bank_activation(bank: nn.Module, params: list[nn.Parameter], args: tuple, kwargs: dict, output) -> torch.Tensor:
    """What multiplies a fused expert bank's down projections, per token: `(*tokens, k * (d_in + biases))`.

    The bank is called as `bank(hidden, index, weights)`, `index` and `weights` of shape `(tokens, k)`.
    It is replayed one routing slot at a time with the down projection swapped for a selector of up
    to `hidden` of its input coordinates (biases zeroed): each replay returns `weight * a` for those
    coordinates, `a` the routed expert's down-projection input. A replay with the down projection zero
    and a bias `e_0` returns the bias's activation (the routing weight). The activations must rebuild
    the bank's actual output, else `_NotMeasurable` (a norm or the routing weight applied elsewhere).
    """
    weight = next((p for p in params if p.dim() == 3), None)
    if weight is None:
        raise _NotMeasurable("not a 3-D (experts, out, in) expert-bank parameter")
    names = {id(p): n for n, p in bank.named_parameters(recurse=False)}
    biases = [p for p in params if p is not weight]
    try:
        bound = inspect.signature(bank.forward).bind(*args, **kwargs)
    except TypeError as err:
        raise _NotMeasurable(f"its call does not bind to its forward ({err})") from None
    keys = list(bound.arguments)[:3]
    index, gates = (bound.arguments[k] for k in keys[1:]) if len(keys) == 3 else (None, None)
    if not all(isinstance(t, torch.Tensor) for t in (output, index, gates)) or index.dim() != 2 or index.shape != gates.shape:
        raise _NotMeasurable("the bank is not called as (hidden, index, weights) with (tokens, k) routing tensors")
    hidden, transposed = output.shape[-1], bool(getattr(bank, "is_transposed", False))
    d_out, d_in = (weight.shape[2], weight.shape[1]) if transposed else (weight.shape[1], weight.shape[2])
    if d_out != hidden or output.numel() != index.shape[0] * hidden:
        raise _NotMeasurable(f"its down projection {tuple(weight.shape)} does not map onto its output {tuple(output.shape)}")

    def replay(slot: int, swap: dict) -> torch.Tensor:
        bound.arguments[keys[1]], bound.arguments[keys[2]] = index[:, slot : slot + 1], gates[:, slot : slot + 1]
        return functional_call(bank, swap, bound.args, bound.kwargs).reshape(-1, hidden).double()

    k, name = index.shape[1], names[id(weight)]
    zero_bias = {names[id(b)]: torch.zeros_like(b) for b in biases}
    buf = torch.zeros_like(weight)  # the one weight-sized buffer: each selector in turn, then zeros
    parts: list[list[torch.Tensor]] = [[] for _ in range(k)]
    rebuilt, cols = torch.zeros(index.shape[0], hidden, dtype=torch.float64, device=output.device), []
    with torch.no_grad():
        for start in range(0, d_in, hidden):  # more input coordinates than the output width: several replays
            i = torch.arange(min(hidden, d_in - start), device=weight.device)
            buf.zero_()
            if transposed:
                buf[:, start + i, i] = 1
            else:
                buf[:, i, start + i] = 1
            for slot in range(k):
                parts[slot].append(replay(slot, {name: buf, **zero_bias})[:, : len(i)])
        buf.zero_()
        for slot in range(k):
            a, expert = torch.cat(parts[slot], dim=1), index[:, slot]
            for e in expert.unique().tolist():
                if 0 <= e < weight.shape[0]:  # an index past the experts is a sentinel the bank skips
                    w_e = weight[e].detach().double()
                    rebuilt[expert == e] += a[expert == e] @ (w_e if transposed else w_e.T)
            cols.append(a)
            for b in biases:
                unit = torch.zeros_like(b)
                unit[..., 0] = 1
                g = replay(slot, {name: buf, **zero_bias, names[id(b)]: unit})[:, :1]
                rebuilt += g * b.detach().double()[expert.clamp(0, b.shape[0] - 1)]
                cols.append(g)
    tol = TOLERANCES.get(output.dtype, 1e-2) * max(1.0, float(output.detach().abs().max()) if output.numel() else 1.0)
    if not torch.allclose(rebuilt, output.detach().reshape(-1, hidden).double(), rtol=0, atol=tol):
        raise _NotMeasurable("replayed one routing slot at a time it does not rebuild its output "
                             "(a norm or the routing weight is applied elsewhere)")
    return torch.cat(cols, dim=1).reshape(*output.shape[:-1], -1)


class _BlockProbe:
    """Hooks on the new blocks: what multiplies each output weight, and a zero leaf added to each block's output."""

    def __init__(self, blocks: list[tuple[nn.Module, list[BlockOutput]]]):
        self.acts: list[tuple[str, torch.Tensor, int]] = []
        self.probes: list[torch.Tensor] = []
        self.unmeasured: str | None = None  # why B_a cannot be measured, once known
        self._replaying = False
        self.handles = []
        for block, outputs in blocks:
            for out in outputs:
                if out.bank:
                    self.handles.append(out.module.register_forward_hook(partial(self._capture_bank, out), with_kwargs=True))
                else:
                    self.handles.append(out.module.register_forward_pre_hook(partial(self._capture_act, out.name)))
            self.handles.append(block.register_forward_hook(self._add_probe))

    def _capture_act(self, name, module, args):
        if self.unmeasured is None:
            self.acts.append((name, args[0].detach(), 1 if getattr(module, "bias", None) is not None else 0))

    def _capture_bank(self, out, module, args, kwargs, output):
        if self._replaying or self.unmeasured is not None:
            return
        self._replaying = True  # the replays call the bank again
        try:
            self.acts.append((out.name, _bank_activation(module, out.params, args, kwargs, output), 0))
        except _NotMeasurable as why:
            self.unmeasured = f"`{out.name}`: {why}"
        finally:
            self._replaying = False

    def _add_probe(self, module, args, output):
        # Adding a zero leaf gives the gradient at this output without cutting the graph below it.
        hidden = output[0] if isinstance(output, tuple) else output
        probe = torch.zeros_like(hidden, requires_grad=True)
        self.probes.append(probe)
        return (hidden + probe, *output[1:]) if isinstance(output, tuple) else hidden + probe

    def clear(self) -> None:
        self.acts.clear(), self.probes.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _example_sq(a: torch.Tensor, has_bias: int, n: int, tokens, mask) -> torch.Tensor | None:
    """One activation's squared norm per example (masked tokens excluded), or `None` where its rows are not the batch's."""
    a = a.double()
    if a.dim() == 2 and tokens is not None:
        # Rows flattened over the batch's tokens (a MoE block's view); other counts are gathered rows.
        if a.shape[0] != tokens[0] * tokens[1]:
            return None
        a = a.reshape(*tokens, a.shape[-1])
    if a.dim() < 2 or a.shape[0] != n:
        return None
    tokens_mask = mask is not None and a.dim() == 3 and mask.shape == a.shape[:2]
    m = mask.to(a.dtype).unsqueeze(-1) if tokens_mask else torch.ones_like(a[..., :1])
    return (a.pow(2) * m).flatten(1).sum(1) + has_bias * m.flatten(1).sum(1)


def _batch_terms(model: nn.Module, batch: dict, index: int, causal: bool, hooks: _BlockProbe) -> tuple[float, float | None]:
    """Largest per-example gradient norm at the blocks' outputs and activation norm (`None`: unmeasurable), on one batch."""
    hooks.clear()
    z = prefix_hidden(model, batch, index)
    with torch.enable_grad(), start_at(model, index, z):
        logits = model(**model_inputs(batch)).logits
        per = example_losses(logits, batch["labels"], causal=causal).per_example
        grads = torch.autograd.grad(per.sum(), hooks.probes)
    rho = float(sum(g.double().pow(2).flatten(1).sum(1) for g in grads).sqrt().max())
    if hooks.unmeasured is not None:
        return rho, None
    mask = batch.get("attention_mask")
    tokens = next((tuple(t.shape) for t in (mask, batch.get("input_ids")) if isinstance(t, torch.Tensor) and t.dim() == 2), None)
    sq_act = 0
    for name, a, has_bias in hooks.acts:
        sq = _example_sq(a, has_bias, per.shape[0], tokens, mask)
        if sq is None:
            hooks.unmeasured = (f"`{name}`: its input {tuple(a.shape)} is not laid out per example or per token (a per-expert "
                                "projection sees only its routed tokens, gathered), so it cannot be attributed to examples")
            return rho, None
        sq_act = sq_act + sq
    return rho, float(torch.as_tensor(sq_act).sqrt().max())


def block_norm_terms(model: nn.Module, data, *, batch_size: int = 8, progress: bool = False) -> dict:
    """Estimate `rho`, `B_a` and compute `B_W` for the new blocks of a grown model (inputs of eps_M).

    Definitions (all new blocks together, as one block with stacked output weights):
    - `B_W = ||W||_F` over every residual-output parameter of every new block
      (`residual_output_targets`: weights and biases, a bias being a weight on a constant activation
      1; of a fused expert bank, only its down projections, not its gate/up projection).
    - `B_a = max_i ||A_i||_F`: the largest, over the examples of `data`, Frobenius norm of the
      activations that multiply those weights, over that example's tokens (attention-masked tokens
      excluded): a projection's input, plus the constant 1 for a bias. For a fused expert bank, the
      input of each routed expert's down projection times the token's routing weight for that expert
      (the bank weights each expert's output, so this is what `W_e` multiplies in the block's output),
      over the tokens routed to it, plus the routing weight for a bias.
    - `rho` (an estimate): `max_i ||d l_i / d H_i||_F`, the largest gradient norm of the example's
      loss with respect to the block's output over its tokens: an empirical Lipschitz estimate of
      `loss o f_top` at the block's output, at the trained weights. A maximum over a sample is a
      lower estimate of the true constant.

    Where `B_a` cannot be measured reliably it is `None` and `b_a_how` says why: a bank that a
    replay does not rebuild, or a per-expert projection (`experts.0.down_proj`) whose input holds only
    its routed tokens, gathered, so they cannot be attributed to examples.

    `data` is any form of the data contract (`hf_depthgrow.data.batches`).

    Example:
        ```python
        >>> terms = block_norm_terms(grown, train_data)
        >>> terms["rho"], terms["b_w"], terms["b_a"]
        ```
    """
    blocks = new_block_outputs(model)
    b_w = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for _, outs in blocks for out in outs for p in out.params))
    batches, ids = prepare_batches({"the model": model}, data, batch_size, None)
    causal, index, device = is_causal_lm(model), lowest_new_index(model), device_of(model)
    hooks = _BlockProbe(blocks)
    rho, b_a = 0.0, 0.0
    try:
        with eval_mode(model), progress_bar(batches, progress, "block terms") as bar:
            for batch in batches:
                batch_rho, batch_b_a = _batch_terms(model, to_device(split_batch(batch)[0], device), index, causal, hooks)
                rho = max(rho, batch_rho)
                b_a = None if batch_b_a is None or b_a is None else max(b_a, batch_b_a)
                bar.update(1)
    finally:
        hooks.remove()
    b_a_how = B_A_HOW if b_a is not None else f"not measured: {hooks.unmeasured}"
    return {"rho": rho, "b_w": b_w, "b_a": b_a, "num_examples": len(ids), "rho_how": RHO_HOW, "b_a_how": b_a_how, "b_w_how": B_W_HOW}


def stone_margin(stone, data, *, what: str, **kwargs) -> tuple[float | None, str | None]:
    """`L(f_old) - L(stone)` on `data` from a grown stepping-stone model, a number, or a result with losses; and how it was obtained."""
    if stone is None:
        return None, None
    if isinstance(stone, (int, float)):
        return float(stone), "given as a number"
    if isinstance(stone, nn.Module):
        if data is None:
            raise ValueError(f"{what}: a stepping-stone model needs the data to measure it on")
        with warnings.catch_warnings():  # only the margin is used, not the intervals, so B does not matter
            warnings.simplefilter("ignore", UserWarning)
            res = evaluate_delta(stone, data, metrics=False, n_bootstrap=1, **kwargs)
        return res.mean_delta, f"measured here: mean per-example delta of the stepping stone vs the original on {res.num_examples} examples"
    if hasattr(stone, "loss_old") and hasattr(stone, "loss_stone"):
        return float(stone.loss_old) - float(stone.loss_stone), "loss_old - loss_stone of the stepping-stone result (on the data it measured)"
    raise TypeError(f"{what}: expected a model, a number or a SteppingStoneResult, got {type(stone).__name__}")


def _trainer_terms(train_result, delta_erm, n_train, sources: dict) -> tuple[float | None, int | None]:
    """`Delta_ERM` and `n` from the arguments or the trainer's result, with where they came from in `sources`."""
    if delta_erm is None and train_result is not None:
        delta_erm = getattr(train_result, "delta_erm", None)
        if delta_erm is not None:
            selected = getattr(train_result, "selected", None)
            sources["delta_erm"] = "from the trainer's result" + (f" (selected model: {selected})" if selected else "")
            if getattr(train_result, "reference", None) == "old":
                # docs/theory.md §4 measures Delta_ERM against f~_S; against f_old it already holds the stone's margin.
                sources["delta_erm"] += (
                    "; measured against f_old, not the stepping stone f~_S (the trainer had none), so the routes "
                    "count the stone's margin twice: train with stepping_stone= for a valid Delta_ERM"
                )
    elif delta_erm is not None:
        sources["delta_erm"] = "given"
    if n_train is None and train_result is not None:
        n_train = next((getattr(train_result, k) for k in ("n_train", "num_train_examples") if getattr(train_result, k, None)), None)
    if n_train is not None:
        sources.setdefault("n_train", "given" if train_result is None else "given / from the trainer's result")
    return delta_erm, n_train


def route_inputs(
    model: nn.Module | None = None,
    *,
    n_train: int | None = None,
    train_result=None,
    delta_erm: float | None = None,
    stone_pop=None,
    held_out=None,
    stone=None,
    test_data=None,
    block_data=None,
    batch_size: int = 8,
    progress: bool = False,
) -> RouteInputs:
    """Gather the Route A/B inputs: take what other modules computed, measure the rest.

    Args:
        model: The trained grown model (for `B_W`, `B_a`, `rho` on `block_data`).
        n_train: Training-set size `n` (or `train_result.n_train` / `num_train_examples` where present).
        train_result: The trainer's result; its `delta_erm` is `Delta_ERM`.
        delta_erm: `Delta_ERM` given directly (overrides `train_result`).
        stone_pop: The population stepping stone `f~_pop` (a grown model, measured on `held_out`), a
            number (`Delta_R`), or a stepping-stone result whose losses were measured on the held-out split.
        held_out: The held-out split for `Delta_R` (any form of the data contract).
        stone: The stepping stone for `Delta^R_test` (a grown model measured on `test_data`, or a number).
        test_data: The test set T.
        block_data: Data for `rho` and `B_a` (the training data, for the Rademacher term).

    Example:
        ```python
        >>> inputs = route_inputs(grown, train_result=tr, stone_pop=pop_model, held_out=held, stone=stone_model,
        ...                       test_data=test, block_data=train)
        >>> result = evaluate_delta(grown, test, loss_bound=20.0, routes=inputs)
        ```
    """
    sources: dict[str, str] = {}
    delta_erm, n_train = _trainer_terms(train_result, delta_erm, n_train, sources)
    delta_r, why = stone_margin(stone_pop, held_out, what="Delta_R (population stepping stone, held-out split)", batch_size=batch_size)
    if why:
        sources["delta_r"] = why
    delta_r_test, why = stone_margin(stone, test_data, what="Delta^R_test (stepping stone, test set)", batch_size=batch_size)
    if why:
        sources["delta_r_test"] = why
    rho = b_w = b_a = None
    if model is not None and block_data is not None:
        terms = block_norm_terms(model, block_data, batch_size=batch_size, progress=progress)
        rho, b_w, b_a = terms["rho"], terms["b_w"], terms["b_a"]
        sources["rho"] = f"{terms['rho_how']}, on {terms['num_examples']} examples"
        sources["b_a"] = f"{terms['b_a_how']}, on {terms['num_examples']} examples" if b_a is not None else terms["b_a_how"]
        sources["b_w"] = terms["b_w_how"]
    return RouteInputs(
        n_train=n_train, delta_erm=None if delta_erm is None else float(delta_erm), delta_r=delta_r,
        delta_r_test=delta_r_test, rho=rho, b_w=b_w, b_a=b_a, sources=sources,
    )
