"""The Route A/B inputs measured on models and data: block norms (`rho`, `B_W`, `B_a`) and stepping-stone margins.

`route_inputs` gathers every input of `hf_depthgrow.evaluation.routes.route_bounds`: it takes what
other modules computed (the trainer's `Delta_ERM`, the training-set size) and measures the rest
here. Data is read through the package's data contract (`hf_depthgrow.data.batches`).
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from ..data.batches import to_device
from ..growth.adapter import hosted_blocks
from ..growth.families import residual_output_modules, resolve_family
from ..growth.prefix import lowest_new_index, prefix_hidden, start_at
from ..growth.record import growth_record
from ..losses import example_losses, is_causal_lm, model_inputs
from .checks import prepare_batches, split_batch
from .paired import device_of, eval_mode, evaluate_delta, progress_bar
from .routes import RouteInputs

RHO_HOW = ("estimate: max over examples of ||d loss_i / d (block output)||_F (empirical Lipschitz of loss o f_top "
           "at the block's output, trained weights)")
B_A_HOW = "max over examples of ||pre-projection activation||_F over the example's tokens (plus 1 per token for a bias)"
B_W_HOW = "||W||_F of the trained block's output projections (weights and biases)"


def new_block_outputs(model: nn.Module) -> list[tuple[nn.Module, list[nn.Module]]]:
    """Each new block with the modules whose output joins the residual stream (its output weights W)."""
    record = growth_record(model)
    if not record:
        raise ValueError("the model has no growth record: there is no new block to measure")
    spec, stack, _ = resolve_family(model)
    out = [(stack[i], residual_output_modules(spec, stack[i])) for i in record.native_indices]
    for layer in stack:
        for hosted in hosted_blocks(layer).values():
            out.extend((block, [block.w_out]) for block in hosted)
    return out


class _BlockProbe:
    """Hooks on the new blocks: each output projection's input activation, and a zero leaf added to each block's output."""

    def __init__(self, blocks):
        self.acts: list[torch.Tensor] = []
        self.bias_tokens: list[int] = []
        self.probes: list[torch.Tensor] = []
        self.handles = [m.register_forward_pre_hook(self._capture_act) for _, mods in blocks for m in mods]
        self.handles += [block.register_forward_hook(self._add_probe) for block, _ in blocks]

    def _capture_act(self, module, args):
        self.acts.append(args[0].detach())
        self.bias_tokens.append(1 if getattr(module, "bias", None) is not None else 0)

    def _add_probe(self, module, args, output):
        # Adding a zero leaf gives the gradient at this output without cutting the graph below it.
        hidden = output[0] if isinstance(output, tuple) else output
        probe = torch.zeros_like(hidden, requires_grad=True)
        self.probes.append(probe)
        return (hidden + probe, *output[1:]) if isinstance(output, tuple) else hidden + probe

    def clear(self) -> None:
        self.acts.clear(), self.bias_tokens.clear(), self.probes.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _batch_terms(model: nn.Module, batch: dict, index: int, causal: bool, hooks: _BlockProbe) -> tuple[float, float]:
    """Largest per-example gradient norm at the blocks' outputs and activation norm, on one batch."""
    hooks.clear()
    z = prefix_hidden(model, batch, index)
    with torch.enable_grad(), start_at(model, index, z):
        logits = model(**model_inputs(batch)).logits
        per = example_losses(logits, batch["labels"], causal=causal).per_example
        grads = torch.autograd.grad(per.sum(), hooks.probes)
    mask = batch.get("attention_mask")
    sq_grad = sum(g.double().pow(2).flatten(1).sum(1) for g in grads)
    sq_act = 0
    for a, has_bias in zip(hooks.acts, hooks.bias_tokens):
        a = a.double()
        tokens_mask = mask is not None and a.dim() == 3 and mask.shape == a.shape[:2]
        m = mask.to(a.dtype).unsqueeze(-1) if tokens_mask else torch.ones_like(a[..., :1])
        sq_act = sq_act + (a.pow(2) * m).flatten(1).sum(1) + has_bias * m.flatten(1).sum(1)
    return float(sq_grad.sqrt().max()), float(torch.as_tensor(sq_act).sqrt().max())


def block_norm_terms(model: nn.Module, data, *, batch_size: int = 8, progress: bool = False) -> dict:
    """Estimate `rho`, `B_a` and compute `B_W` for the new blocks of a grown model (inputs of eps_M).

    Definitions (all new blocks together, as one block with stacked output weights):
    - `B_W = ||W||_F` over every output projection of every new block (weights and biases: a bias
      is a weight on a constant activation 1).
    - `B_a = max_i ||A_i||_F`: the largest, over the examples of `data`, Frobenius norm of the
      block's pre-projection activation (the inputs of its output projections, plus the constant 1
      for a bias), over that example's tokens (attention-masked tokens excluded).
    - `rho` (an estimate): `max_i ||d l_i / d H_i||_F`, the largest gradient norm of the example's
      loss with respect to the block's output over its tokens: an empirical Lipschitz estimate of
      `loss o f_top` at the block's output, at the trained weights. A maximum over a sample is a
      lower estimate of the true constant.

    `data` is any form of the data contract (`hf_depthgrow.data.batches`).

    Example:
        ```python
        >>> terms = block_norm_terms(grown, train_data)
        >>> terms["rho"], terms["b_w"], terms["b_a"]
        ```
    """
    blocks = new_block_outputs(model)
    b_w = math.sqrt(
        sum(float(p.detach().double().pow(2).sum()) for _, mods in blocks for m in mods for p in m.parameters(recurse=False))
    )
    batches, ids = prepare_batches({"the model": model}, data, batch_size, None)
    causal, index, device = is_causal_lm(model), lowest_new_index(model), device_of(model)
    hooks = _BlockProbe(blocks)
    rho, b_a = 0.0, 0.0
    try:
        with eval_mode(model), progress_bar(batches, progress, "block terms") as bar:
            for batch in batches:
                batch_rho, batch_b_a = _batch_terms(model, to_device(split_batch(batch)[0], device), index, causal, hooks)
                rho, b_a = max(rho, batch_rho), max(b_a, batch_b_a)
                bar.update(1)
    finally:
        hooks.remove()
    return {"rho": rho, "b_w": b_w, "b_a": b_a, "num_examples": len(ids), "rho_how": RHO_HOW, "b_a_how": B_A_HOW, "b_w_how": B_W_HOW}


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
                # THEORY §4 measures Delta_ERM against f~_S; against f_old it already holds the stone's margin.
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
        sources["b_a"] = f"{terms['b_a_how']}, on {terms['num_examples']} examples"
        sources["b_w"] = terms["b_w_how"]
    return RouteInputs(
        n_train=n_train, delta_erm=None if delta_erm is None else float(delta_erm), delta_r=delta_r,
        delta_r_test=delta_r_test, rho=rho, b_w=b_w, b_a=b_a, sources=sources,
    )
