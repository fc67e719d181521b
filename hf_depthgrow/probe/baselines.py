"""Cheap baseline predictors of where a new block helps, to hold the probe's ranking against.

Every predictor returns one score per candidate position k (the index `grow_depth(model, [k])`
inserts at), with **higher = predicted better**, so that all of them can be compared with the
realized gains of an oracle sweep by one rank correlation:

- `layer_gradient_norms`: `||dL/dW||` of the original layer the new block at k copies (layer k-1;
  layer 0 for k = 0). A layer the loss is sensitive to is predicted to be worth duplicating.
- `block_influence`: ShortGPT's block influence `1 - cos(x_in, x_out)` of the same layer. A layer
  that changes the residual stream much is predicted to be worth duplicating (the opposite
  hypothesis, "grow where layers are redundant", is the same score negated: a negative rank
  correlation with the oracle says so).
- `depth`: k itself, the "grow on top" baseline.
- `lookahead` (`lookahead.lookahead_scores`): the held-out loss drop after a few steps of training
  the new block alone, from the cached prefix.
- `signal`, `z`: the probe's own numbers (`hf_depthgrow.probe.signal.probe`).

`predictor_scores` runs any subset of them and reports each one's cost in seconds.

Example:
    ```python
    >>> from hf_depthgrow.probe.baselines import predictor_scores
    >>> out = predictor_scores(model, rows, [0, 2, 4], which=("gradient_norm", "depth"))
    >>> out["scores"]["depth"]
    [0.0, 2.0, 4.0]
    ```
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Iterable

import torch
from torch import nn

from ..data.batches import as_batches, to_device
from ..data.checks import check_batch
from ..growth import adapter
from ..losses import example_losses, is_causal_lm, labels_of, model_inputs
from .capture import checked_positions, forward_kwargs
from .placement_rules import PLACEMENT_RULES, adept_scores, midas_scores
from .result import ProbeResult
from .signal import NO_SUPERVISION

__all__ = ["PREDICTORS", "block_influence", "layer_gradient_norms", "predictor_scores", "source_layer"]

PREDICTORS = ("signal", "z", "gradient_norm", "block_influence", "depth", "lookahead")
# Keyword arguments `predictor_scores` hands on, and to which predictors.
_OPTIONS = {
    "batch_size": {"signal", "z", "gradient_norm", "block_influence", "lookahead", "adept"},
    "max_batches": {"signal", "z", "gradient_norm", "block_influence", "adept"},
    "retention_data": {"adept"},
    "steps": {"lookahead"},
    "learning_rate": {"lookahead"},
    "seed": {"lookahead"},
    "progress": {"lookahead"},
}


class _Stop(Exception):
    """Ends a forward pass once the highest layer of interest has run (the head is not needed)."""


def source_layer(position: int) -> int:
    """The original layer a native block at `position` copies: k-1, or 0 for k = 0 (`PlacementEntry.source`)."""
    return max(position - 1, 0)


@contextmanager
def _untouched(model: nn.Module):
    """Eval mode inside; every `requires_grad` flag and training mode restored on exit, also on error.

    Gradients are taken with `torch.autograd.grad`, so `.grad` is never written.
    """
    flags = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        for m, mode in modes:
            m.training = mode


def _layer_parameters(layer: nn.Module) -> list[nn.Parameter]:
    """The layer's own parameters, without adapter blocks an earlier growth hung on it."""
    return [p for n, p in layer.named_parameters() if not n.startswith((adapter.PRE, adapter.POST))]


def layer_gradient_norms(model: nn.Module, data, positions: Iterable[int] | None, *, batch_size: int = 8,
                         max_batches: int | None = None) -> list[float]:
    """Per position k, `||dL/dW||_F` over all parameters of the layer the new block at k copies.

    `L` is the model's head loss over all of `data` (token-weighted for causal LMs, per example for
    classifiers, as in `probe`); the layer is `source_layer(k)` (k-1; 0 for k = 0). One forward and
    one backward of the original model per batch, in eval mode, differentiating only the layers
    needed. The model is left as it was (flags, training modes; `.grad` is never written).

    Args:
        model: A model of a family `grow_depth` supports (not grown by this function).
        data: Any form of `hf_depthgrow.data.batches`, with `labels`.
        positions: Candidate positions, 0 <= k <= L, in the order the scores come back; `None`: 0..L.
        batch_size, max_batches: How rows are batched, and how many batches are read.

    Returns:
        One norm per position, aligned with `positions`.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
        >>> model = tiny_model("llama")
        >>> norms = layer_gradient_norms(model, tiny_inputs(model), [0, 1, 4])
        >>> norms[0] == norms[1]  # k = 0 and k = 1 both copy layer 0
        True
        ```
    """
    stack, positions = checked_positions(model, positions)
    layers = sorted({source_layer(k) for k in positions})
    params = {j: _layer_parameters(stack[j]) for j in layers}
    flat = [p for j in layers for p in params[j]]
    batches = as_batches(data, batch_size=batch_size, max_batches=max_batches)
    causal, kwargs = is_causal_lm(model), forward_kwargs(model)
    weight, count = 0.0, 0
    with _untouched(model):
        for p in model.parameters():
            p.requires_grad_(False)
        for p in flat:  # only the layers asked about: the backward stops at the lowest one
            p.requires_grad_(True)
        grads = None
        for index, batch in enumerate(batches):
            check_batch(model, batch, where=f"the data (batch {index})")
            batch = to_device(batch, flat[0].device)
            with torch.enable_grad():
                losses = example_losses(model(**model_inputs(batch), **kwargs).logits, labels_of(batch), causal=causal)
                batch_weight = float(losses.weight.sum())
                if batch_weight > 0:  # else the gradient is exactly zero (every target ignored)
                    batch_grads = torch.autograd.grad(losses.total.sum(), flat, allow_unused=True)
                    # Summed in float32 at least: a bf16 model's per-batch gradients would lose digits.
                    batch_grads = [torch.zeros_like(p, dtype=torch.float32) if g is None else g.float()
                                   for g, p in zip(batch_grads, flat)]
                    grads = batch_grads if grads is None else [a + b for a, b in zip(grads, batch_grads)]
            weight += batch_weight
            count += 1
    if count == 0:
        raise ValueError("data yielded no batches")
    if weight == 0 or grads is None:
        raise ValueError(NO_SUPERVISION.replace("the probe data", "the data"))
    # The gradient of the mean loss is the summed gradient over the total weight (tokens or examples).
    norms, start = {}, 0
    for j in layers:
        part = grads[start : start + len(params[j])]
        start += len(params[j])
        norms[j] = math.sqrt(sum(float(g.double().square().sum()) for g in part)) / weight
    return [norms[source_layer(k)] for k in positions]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine per token over the last dimension, in float64; exactly 1 where `a` and `b` are identical.

    Written out (not `F.cosine_similarity`) so that for `a == b` the three sums are the same operation
    on the same numbers, and `sqrt(s * s) == s` then makes the quotient exactly 1.
    """
    a, b = a.double(), b.double()
    dot, na, nb = (a * b).sum(-1), (a * a).sum(-1), (b * b).sum(-1)
    return dot / torch.sqrt(na * nb).clamp_min(1e-300)


def _token_mask(batch: dict, hidden: torch.Tensor) -> torch.Tensor | None:
    """Non-padding tokens `[B, T]` from the attention mask, where it lines up with the hidden states."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tuple(mask.shape) == tuple(hidden.shape[:2]):
        return mask.to(hidden.device).bool()
    return None  # images (every patch counts) or a model that adds tokens of its own


class _LayerTap:
    """Forward hooks recording each wanted layer's input and output hidden states (the layer proper:
    after any pre-adapter it hosts, before any post-adapter), and stopping after the highest one."""

    def __init__(self, stack: nn.ModuleList, layers: list[int]):
        self.io: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        top = max(layers)
        for j in layers:
            self.handles.append(stack[j].register_forward_pre_hook(self._pre(j), with_kwargs=True))
            self.handles.append(stack[j].register_forward_hook(self._post(j, j == top), prepend=True))

    def _pre(self, j: int):
        def hook(module, args, kwargs):
            self.io[j] = [args[0] if args else kwargs["hidden_states"]]

        return hook

    def _post(self, j: int, last: bool):
        def hook(module, args, output):
            self.io[j].append(output[0] if isinstance(output, tuple) else output)
            if last:
                raise _Stop

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def block_influence(model: nn.Module, data, positions: Iterable[int] | None, *, batch_size: int = 8,
                    max_batches: int | None = None) -> list[float]:
    """Per position k, ShortGPT's block influence `1 - cos(x_in, x_out)` of the layer the new block at k copies.

    `x_in` and `x_out` are the residual stream entering and leaving layer `source_layer(k)` (k-1; 0 for
    k = 0), taken with forward hooks on the layer itself (so no family's final norm or embedding
    scaling can shift the index). The cosine is per token, averaged over every non-padding token of
    `data` (`attention_mask`; every token of an image). No gradient; the forward stops after the
    highest layer needed. `labels` are not needed.

    Args:
        model: A model of a family `grow_depth` supports; left as it was.
        data: Any form of `hf_depthgrow.data.batches`.
        positions: Candidate positions, 0 <= k <= L, in the order the scores come back; `None`: 0..L.
        batch_size, max_batches: How rows are batched, and how many batches are read.

    Returns:
        One influence in [0, 2] per position, aligned with `positions`; 0 for a layer that is the identity.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
        >>> model = tiny_model("llama")
        >>> influence = block_influence(model, tiny_inputs(model), None)
        >>> len(influence) == model.config.num_hidden_layers + 1
        True
        ```
    """
    stack, positions = checked_positions(model, positions)
    layers = sorted({source_layer(k) for k in positions})
    batches = as_batches(data, batch_size=batch_size, max_batches=max_batches)
    device, kwargs = next(model.parameters()).device, forward_kwargs(model)
    totals = {j: 0.0 for j in layers}
    tokens, count = 0, 0
    with _untouched(model), torch.no_grad():
        tap = _LayerTap(stack, layers)
        try:
            for index, batch in enumerate(batches):
                if "labels" in batch:  # a tokenizer that does not fit the model, caught before its IndexError
                    check_batch(model, batch, where=f"the data (batch {index})")
                batch = to_device(batch, device)
                tap.io = {}
                try:
                    model(**model_inputs(batch), **kwargs)
                except _Stop:
                    pass
                x_in = tap.io[layers[0]][0]
                mask = _token_mask(batch, x_in)
                tokens += int(mask.sum()) if mask is not None else x_in.shape[0] * x_in.shape[1]
                for j in layers:
                    influence = 1.0 - _cosine(*tap.io[j])
                    totals[j] += float(influence[mask].sum() if mask is not None else influence.sum())
                count += 1
        finally:
            tap.remove()
    if count == 0:
        raise ValueError("data yielded no batches")
    if tokens == 0:
        raise ValueError("the data has no token: every attention_mask entry is 0")
    return [totals[source_layer(k)] / tokens for k in positions]


def _from_probe(result: ProbeResult, positions: list[int], field: str) -> list[float]:
    """`result.<field>` re-ordered to `positions`; a position the probe did not score is an error."""
    if not isinstance(result, ProbeResult):
        raise ValueError(f"probe_result must be a ProbeResult, got {type(result).__name__}")
    index = {k: i for i, k in enumerate(result.positions)}
    missing = sorted({k for k in positions if k not in index})
    if missing:
        raise ValueError(f"probe_result has no score for positions {missing} (it scored {result.positions}); "
                         "rerun the probe with these positions or drop them")
    return [float(getattr(result, field)[index[k]]) for k in positions]


def _route(which, kwargs: dict) -> tuple[list[str], dict[str, dict]]:
    """The requested predictors, checked, and the keyword arguments each one gets."""
    if isinstance(which, str):
        which = (which,)
    which = list(dict.fromkeys(which))
    unknown = [w for w in which if w not in PREDICTORS + PLACEMENT_RULES]  # the rules run only when named
    if unknown or not which:
        raise ValueError(f"unknown predictor(s) {unknown or which}; valid names: {', '.join(PREDICTORS + PLACEMENT_RULES)}")
    bad = sorted(set(kwargs) - set(_OPTIONS))
    if bad:
        raise ValueError(f"unknown option(s) {bad}; predictor_scores takes {', '.join(sorted(_OPTIONS))}")
    return which, {name: {k: v for k, v in kwargs.items() if name in _OPTIONS[k]} for name in PREDICTORS + PLACEMENT_RULES}


def predictor_scores(model: nn.Module, data, positions: Iterable[int] | None, *, eval_data=None,
                     probe_result: ProbeResult | None = None, which=PREDICTORS, **kwargs) -> dict:
    """Scores of several predictors of where a new block helps, and what each one cost.

    Every score list is aligned with `positions` and oriented so that higher = predicted better.
    `signal` and `z` come from `probe_result` (re-ordered to `positions`; their cost is then NaN: not
    measured here) or from one `probe` run shared by both (their cost is that run's). `depth` is k
    itself (costs nothing). `lookahead` needs `eval_data`.

    Args:
        model: A model of a family `grow_depth` supports; left as it was.
        data: Training data, any form of `hf_depthgrow.data.batches`, with `labels`.
        positions: Candidate positions, 0 <= k <= L; `None`: 0..L.
        eval_data: Held-out data for `lookahead`.
        probe_result: A `ProbeResult` covering every position, for `signal` and `z`.
        which: Names among `PREDICTORS`: `signal`, `z`, `gradient_norm`, `block_influence`, `depth`, `lookahead`;
            or the literature's rules `adept`, `midas` (`placement_rules`; `adept` needs `retention_data=`).
        kwargs: `batch_size` (every predictor that reads data), `max_batches` (all but `lookahead`, which
            trains on all of `data`), `steps`, `learning_rate`, `seed`, `progress` (`lookahead`).

    Returns:
        `{"positions": [...], "scores": {name: [float per position]}, "seconds": {name: float}}`.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
        >>> model = tiny_model("llama")
        >>> rows = [tiny_inputs(model, seed=s) for s in range(4)]
        >>> out = predictor_scores(model, rows, [1, 3], which=("gradient_norm", "block_influence", "depth"))
        >>> sorted(out["scores"]), out["scores"]["depth"]
        (['block_influence', 'depth', 'gradient_norm'], [1.0, 3.0])
        ```
    """
    which, options = _route(which, kwargs)
    _, positions = checked_positions(model, positions)
    if "lookahead" in which and eval_data is None:
        raise ValueError("the 'lookahead' predictor scores the held-out loss drop: pass eval_data")
    scores, seconds = {}, {}
    if {"signal", "z"} & set(which):
        start = time.perf_counter()
        if probe_result is None:
            from .signal import probe

            probe_result = probe(model, data, positions=sorted(set(positions)), covariance=False, progress=False,
                                 **options["signal"])
            cost = time.perf_counter() - start
        else:
            cost = math.nan
        for name in ("signal", "z"):
            if name in which:
                scores[name], seconds[name] = _from_probe(probe_result, positions, name), cost
    runners = {
        "gradient_norm": lambda o: layer_gradient_norms(model, data, positions, **o),
        "block_influence": lambda o: block_influence(model, data, positions, **o),
        "depth": lambda o: [float(k) for k in positions],
        "lookahead": lambda o: _lookahead(model, data, positions, eval_data, o),
        "adept": lambda o: adept_scores(model, positions, **o),  # placement_rules: needs retention_data=
        "midas": lambda o: midas_scores(model, positions),
    }
    for name in which:
        if name in runners:
            start = time.perf_counter()
            scores[name] = runners[name](options[name])
            seconds[name] = time.perf_counter() - start
    return {"positions": positions, "scores": {n: scores[n] for n in which}, "seconds": {n: seconds[n] for n in which}}


def _lookahead(model, data, positions, eval_data, options) -> list[float]:
    from .lookahead import lookahead_scores  # trains: pulls in accelerate only when asked for

    return lookahead_scores(model, data, positions, eval_data=eval_data, **options)
