"""Where to grow: the first-order signal of a zero-initialised block at every depth (docs/theory.md §2, §5, §6).

For a candidate position k the grown model is `f_top(z + h_theta(z))` with `h_0 = 0`. At
`theta = 0` the model is unchanged, so the gradient of the training loss with respect to the
block's parameters is the vector-Jacobian product of the block output `z + h_theta(z)` with the
activation gradient `g = dl/dz` of the *original* model, and only the zeroed output projections
get a non-zero gradient. The probe therefore needs, per batch, one forward and one backward of
the original model (gradients with respect to activations only: no weight gradients) plus one
cheap forward of each candidate block on the captured `z` (`capture`). From the per-batch
gradients it reports the empirical signal `||G_S(k)||_F`, an unbiased estimate of the population
signal `||G_D(k)||^2` with a standard error and z-score, the activation-gradient covariance
statistics and the norm regime at every position (`statistics`), and a recommendation (`result`).

The population signal is estimated without bias as the (weighted) mean of `<G_b, G_b'>` over pairs
of distinct batches, which requires batches to be independent samples; its standard error comes from
a delete-a-group jackknife over `num_splits` groups of batches (dealt round-robin). At least 3
batches are needed for a standard error; more than `2 * num_splits` is better.

Example:
    ```python
    >>> from hf_depthgrow.probe.signal import probe
    >>> result = probe(model, loader)  # loader yields dicts with labels
    >>> result.recommendation["positions"], result.z
    ```
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from ..chunked_loss import model_example_losses
from ..data.batches import as_batches, to_device
from ..data.checks import check_batch
from ..growth.config import GrowthConfig
from ..growth.checks import check_positions, resolve_block_kind
from ..growth.families import FamilySpec, model_eps
from ..growth.towers import resolve_family
from ..losses import IGNORE_INDEX, is_causal_lm, labels_of, model_inputs
from ..utils import check_int
from .capture import CandidateBlock, ResidualTap, next_norm_eps
from .result import VERDICT_IMPROVABLE, VERDICT_NOT_OBSERVABLE, Z_THRESHOLD, ProbeResult, recommend
from .statistics import PositionStats, token_mask, token_var

__all__ = ["VERDICT_IMPROVABLE", "VERDICT_NOT_OBSERVABLE", "Z_THRESHOLD", "ProbeResult", "probe"]


@dataclass
class _Plan:
    """One probe run: the model's family, the block kind, and per position its candidate and statistics."""

    model: nn.Module
    spec: FamilySpec
    stack: nn.ModuleList
    cfg: GrowthConfig
    kind: str
    positions: list[int]
    candidates: list[CandidateBlock]
    stats: list[PositionStats]
    norm_eps: list[float]
    causal: bool
    forward_kwargs: dict
    # Running totals over the batches read so far.
    loss: float = 0.0
    weight: float = 0.0
    examples: int = 0
    batches: int = 0
    chunk_size: object = "auto"  # the loss over chunks of tokens (`hf_depthgrow.chunked_loss`)


def _check_options(num_splits, norm_factor, z_threshold, stop_patience) -> None:
    check_int("num_splits", num_splits, 2)
    if not norm_factor > 0:
        raise ValueError(f"norm_factor must be > 0, got {norm_factor!r}")
    # A NaN threshold would make every comparison false: every position "not observable", silently.
    if isinstance(z_threshold, bool) or not isinstance(z_threshold, (int, float)) or not math.isfinite(z_threshold):
        raise ValueError(f"z_threshold must be a finite number, got {z_threshold!r}")
    check_int("stop_patience", stop_patience, 1, allow_none=True)


def supervised_units(labels: torch.Tensor, causal: bool) -> int:
    """Tokens (causal LM: labels after the first, which is never predicted) or examples the loss averages over."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum()) if causal else int(labels.shape[0])


NO_SUPERVISION = (
    "the probe data has no supervised token: every label is -100 (the first label of an example is never "
    "predicted), so the loss and its gradient are undefined. Set labels = input_ids where the loss should count."
)


def _non_finite(what: str, value, index: int) -> ValueError:
    return ValueError(
        f"the {what} is {value} on batch {index} (counting from 0): the model or data produce non-finite values "
        "(check the weights for NaN/inf and the inputs' range)"
    )


def _plan(model: nn.Module, positions, cfg: GrowthConfig, num_splits: int, covariance: bool) -> _Plan:
    """Resolve the family and positions and build the candidate block and statistics of each position."""
    spec, stack, _ = resolve_family(model)
    num_layers = len(stack)
    positions = sorted(set(check_positions(list(range(num_layers + 1)) if positions is None else positions, num_layers)))
    kind = resolve_block_kind(cfg, spec, model.config)
    own_eps = model_eps(spec, model.config)
    if kind == "native" and cfg.eps is not None and own_eps is not None and cfg.eps != own_eps:
        raise ValueError(
            f"native blocks use the family's norms with the config's eps ({own_eps}); use block='adapter' for a block with eps={cfg.eps}."
        )
    candidates = [CandidateBlock(model, stack, spec, k, cfg) for k in positions]
    device = candidates[0].params[0].device
    stats = [PositionStats(c.numel, num_splits, device, covariance) for c in candidates]
    norm_eps = [next_norm_eps(model, spec, stack, k) for k in positions]
    forward_kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    return _Plan(model, spec, stack, cfg, kind, positions, candidates, stats, norm_eps, is_causal_lm(model), forward_kwargs)


@contextmanager
def _frozen(plan: _Plan):
    """Eval mode and frozen parameters (the backward then computes activation gradients only); every flag,
    training mode and hook is restored or removed on exit, also on error."""
    model = plan.model
    flags = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    tap = None
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        model.eval()
        call_layers = {c.source for c in plan.candidates if c.source is not None}
        tap = ResidualTap(plan.stack, set(plan.positions), call_layers, before_adapters=plan.kind == "native")
        yield tap
    finally:
        if tap is not None:
            tap.remove()
        for cand in plan.candidates:
            cand.close()
        for p, flag in flags:
            p.requires_grad_(flag)
        for m, mode in modes:
            m.training = mode


def _add_batch(plan: _Plan, tap: ResidualTap, index: int, batch: dict, norm_factor: float) -> None:
    """One forward and one backward of the original model; every position's statistics take the batch."""
    # Checked before the forward: a tokenizer that does not match the model is an IndexError inside it.
    check_batch(plan.model, batch, where=f"the probe data (batch {index})")
    batch = to_device(batch, plan.candidates[0].params[0].device)
    labels = labels_of(batch)
    tap.clear()
    with torch.enable_grad():
        inputs = {**model_inputs(batch), **plan.forward_kwargs}
        losses = model_example_losses(plan.model, inputs, labels, causal=plan.causal, chunk_size=plan.chunk_size)
        loss_sum = losses.total.sum()
        weight = float(losses.weight.sum())
        loss_value = float(loss_sum.detach())
        if not math.isfinite(loss_value):
            raise _non_finite("loss", loss_value, index)
        zs = [tap.z.get(k) for k in plan.positions]
        missing = [k for k, z in zip(plan.positions, zs) if z is None]
        if missing:  # pragma: no cover - guarded by the hooks
            raise RuntimeError(f"no residual stream captured at positions {missing}")
        # No supervised token: the gradient is exactly zero (ignored targets), so the backward is skipped.
        gs = torch.autograd.grad(loss_sum, zs, allow_unused=True) if weight > 0 else [None] * len(zs)
    del losses, loss_sum
    finite = [torch.isfinite(g).all() for g in gs if g is not None]
    if finite and not bool(torch.stack(finite).all()):  # one device sync for all positions
        raise _non_finite("activation gradient", "not finite", index)
    plan.loss += loss_value
    plan.weight += weight
    plan.examples += int(labels.shape[0])
    plan.batches += 1
    for cand, stats, eps, z, g in zip(plan.candidates, plan.stats, plan.norm_eps, zs, gs):
        g = torch.zeros_like(z) if g is None else g
        call = tap.calls.get(cand.source) if cand.source is not None else None
        stats.add_gradient(index, cand.gradient(z, g, call), weight)
        mask = token_mask(batch, z)
        g_rows = g.reshape(-1, g.shape[-1]) if mask is None else g[mask]
        var = token_var(z, plan.spec.norm)
        var = var.reshape(-1) if mask is None else var[mask]
        stats.add_tokens(g_rows, var, norm_factor * eps)
    tap.clear()


def _run(plan: _Plan, batches, norm_factor: float, progress: bool, stop: "_Stop | None" = None) -> None:
    from tqdm.auto import tqdm

    try:
        total = len(batches)
    except TypeError:  # a DataLoader over an iterable-style dataset
        total = None
    with _frozen(plan) as tap:
        for index, batch in enumerate(tqdm(batches, total=total, disable=not progress, desc="probe", unit="batch")):
            _add_batch(plan, tap, index, batch, norm_factor)
            if stop is not None and stop.done(plan, total):
                break
    if plan.batches == 0:
        raise ValueError("data yielded no batches")
    if plan.weight == 0:
        raise ValueError(NO_SUPERVISION)


@dataclass
class _Stop:
    """Sequential stopping: stop reading batches once the recommendation has not changed for `patience` batches.

    The recommendation (grow or not, and the ranked positions it names) is recomputed after every batch
    from the z-scores so far; from `MIN_BATCHES` batches on (a standard error needs 3), `patience`
    consecutive batches that leave it unchanged end the probe. `reason` says what happened.
    """

    patience: int
    z_threshold: float
    last: tuple | None = None
    same: int = 0
    reason: str | None = None
    trace: list = field(default_factory=list)  # what was watched after each batch (`ProbeResult.recommendation_trace`)

    MIN_BATCHES = 4

    def done(self, plan: _Plan, total: int | None) -> bool:
        if plan.batches < 3:
            return False
        pops = [st.population() for st in plan.stats]
        zs = [_z_score(*pop) for pop in pops]
        rec = recommend(list(plan.positions), zs, [not math.isnan(z) and z > self.z_threshold for z in zs],
                        num_layers=plan.model.config.num_hidden_layers)
        now = (rec["grow"], tuple(rec["positions"]))
        ses = sorted(se for _, se in pops if math.isfinite(se))
        self.trace.append({"batches": plan.batches, "grow": now[0], "positions": list(now[1]),
                           "median_se": ses[len(ses) // 2] if ses else math.nan})
        self.same = self.same + 1 if now == self.last else 0
        self.last = now
        if plan.batches < self.MIN_BATCHES or self.same < self.patience or plan.batches == total:
            return False
        of = f" of at most {total}" if total is not None else ""
        self.reason = (f"stopped after {plan.batches}{of} batches: the recommendation ({'grow at' if now[0] else 'do not grow;'} "
                       f"{list(now[1])}) did not change over the last {self.patience} batches")
        return True


def _z_score(u: float, se: float) -> float:
    if math.isnan(u) or math.isnan(se):
        return math.nan
    if se > 0:
        return u / se
    return 0.0 if u <= 0 else math.inf


def _position_rows(plan: _Plan, z_threshold: float, keep_gradients: bool) -> dict[str, list]:
    """Every per-position field of `ProbeResult`, from the statistics of each candidate."""
    rows = {key: [] for key in ("signal", "signal_parts", "population", "population_se", "population_signal", "z",
                                "verdict", "improvable", "near_singular_share", "mean_var", "min_var", "gradients")}
    covariance = {key: [] for key in ("offdiag_share", "spectral_norm", "stable_rank", "trace")}
    for cand, st in zip(plan.candidates, plan.stats):
        g_total = st.total() / max(plan.weight, 1e-300)
        per_param = cand.unflatten(g_total)
        u, se = st.population()
        z = _z_score(u, se)
        signal = float(g_total.double().norm())
        # No first-order signal at all (e.g. the loss does not depend on this residual stream) is never improvable.
        ok = signal > 0 and not math.isnan(z) and z > z_threshold
        row = {
            "signal": signal,
            "signal_parts": {name: float(t.double().norm()) for name, t in per_param.items()},
            "population": u, "population_se": se, "population_signal": math.sqrt(u) if u > 0 else 0.0,
            "z": z, "verdict": VERDICT_IMPROVABLE if ok else VERDICT_NOT_OBSERVABLE, "improvable": ok,
            "near_singular_share": st.near / st.tokens if st.tokens else math.nan,
            "mean_var": st.var_sum / st.tokens if st.tokens else math.nan,
            "min_var": st.var_min if st.tokens else math.nan,
            "gradients": per_param,
        }
        for key, value in row.items():
            rows[key].append(value)
        for key, value in st.covariance().items():
            covariance[key].append(value)
    if not keep_gradients:
        rows["gradients"] = None
    return {**rows, **covariance}


def _assemble(plan: _Plan, num_splits: int, z_threshold: float, norm_factor: float, keep_gradients: bool) -> ProbeResult:
    model, cfg, kind = plan.model, plan.cfg, plan.kind
    rows = _position_rows(plan, z_threshold, keep_gradients)
    return ProbeResult(
        model_type=str(getattr(model.config, "model_type", "")),
        num_layers=model.config.num_hidden_layers,
        block=kind,
        init=cfg.init if kind == "native" else "random",
        seed=cfg.seed,
        eps=cfg.eps if cfg.eps is not None else model_eps(plan.spec, model.config),
        adapter_dim=cfg.adapter_dim,
        adapter_act=cfg.adapter_act,
        positions=list(plan.positions),
        norm_eps=plan.norm_eps,
        loss=plan.loss / max(plan.weight, 1e-300),
        num_batches=plan.batches,
        num_examples=plan.examples,
        total_weight=plan.weight,
        weight_unit="supervised tokens" if plan.causal else "examples",
        num_splits=num_splits,
        z_threshold=z_threshold,
        norm_factor=norm_factor,
        recommendation=recommend(list(plan.positions), rows["z"], rows["improvable"], signal=rows["signal"],
                                 num_layers=model.config.num_hidden_layers),
        **rows,
    )


def probe(
    model: nn.Module,
    data,
    *,
    positions: Iterable[int] | None = None,
    block: str = "auto",
    init: str = "copy",
    seed: int = 0,
    eps: float | None = None,
    adapter_dim: int | None = None,
    adapter_act: str = "gelu",
    num_splits: int = 8,
    z_threshold: float = Z_THRESHOLD,
    norm_factor: float = 100.0,
    covariance: bool = True,
    max_batches: int | None = None,
    collate_fn: Callable | None = None,
    batch_size: int = 8,
    keep_gradients: bool = False,
    progress: bool = True,
    chunk_size="auto",
    stop_patience: int | None = None,
) -> ProbeResult:
    """Measure, for every candidate depth k, whether a zero-initialised block there can lower the loss.

    `signal[i] = ||G_S(k)||_F` is the norm of the gradient of the training loss (the head's own,
    over all of `data`: token-weighted for causal LMs, per example for classifiers) with respect to
    all parameters of the block `grow_depth(model, [k], block=block, init=init, seed=seed, eps=eps,
    adapter_dim=adapter_dim, adapter_act=adapter_act)` would insert, at its zero init: what autograd
    gives on the grown model, from one forward and one backward of the original per batch. A
    position is `"improvable"` where the z-score of the population signal exceeds `z_threshold`
    (see the module docstring). The model runs in eval mode; its flags, `.grad` and hooks are left
    as they were, also on error.

    Args:
        model: A `*ForCausalLM`, `*ForSequenceClassification` or `*ForImageClassification` of a family `grow_depth` supports.
        data: Any form of `hf_depthgrow.data.batches` (a dataset or list of rows, batched in order with
            `batch_size` and `collate_fn`; a DataLoader or list of batch dicts; one batch dict), with `labels`.
        positions: Candidate positions, 0 <= k <= L; default all of `0..L`. Sorted, duplicates dropped.
        block, init, seed, eps, adapter_dim, adapter_act: As in `GrowthConfig`: the block probed at each position.
        num_splits: Number of batch groups for the jackknife standard error.
        z_threshold: z-score above which a position is called improvable (default `Z_THRESHOLD`, calibrated
            against certified gains after training; 2.0 is the old, one-sided-test reading).
        norm_factor: A token is near-singular for the next norm when `var(z) <= norm_factor * eps`.
        covariance: Accumulate `Sigma_k = E[g g^T]` (a `d x d` matrix per position).
        max_batches: Read at most this many batches.
        collate_fn, batch_size: How rows are batched (default `hf_depthgrow.data.batches.collate`).
        keep_gradients: Keep `G_S(k)` per block parameter in `result.gradients` (for stepping stones).
        progress: Show a tqdm progress bar.
        chunk_size: A causal LM's loss over chunks of tokens without the full logits (`hf_depthgrow.chunked_loss`):
            `"auto"` (where the vocabulary makes them large), tokens per chunk, or `None` (plain).
        stop_patience: Sequential stopping: read batches only until the recommendation (grow or not, and
            the positions ranked by z) has stayed the same for this many consecutive batches (from 4
            batches on); `result.stopping` says where it stopped. `None` (default): read every batch.
            A stop saves probe passes at the price of wider intervals (`population_se`) than all batches give.
            With it, `result.recommendation_trace` holds the recommendation after every batch from the 3rd.

    Returns:
        A `ProbeResult`.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
        >>> model = tiny_model("llama")
        >>> result = probe(model, [tiny_inputs(model, seed=s) for s in range(6)], progress=False)
        >>> len(result.signal) == model.config.num_hidden_layers + 1
        True
        ```
    """
    _check_options(num_splits, norm_factor, z_threshold, stop_patience)
    cfg = GrowthConfig(block=block, init=init, eps=eps, seed=seed, adapter_dim=adapter_dim, adapter_act=adapter_act)
    batches = as_batches(data, batch_size=batch_size, collate_fn=collate_fn, max_batches=max_batches)
    plan = _plan(model, positions, cfg, num_splits, covariance)
    plan.chunk_size = chunk_size
    stop = _Stop(stop_patience, z_threshold) if stop_patience is not None else None
    _run(plan, batches, norm_factor, progress, stop)
    result = _assemble(plan, num_splits, z_threshold, norm_factor, keep_gradients)
    if stop is not None:
        result.stopping, result.recommendation_trace = stop.reason, stop.trace
    return result
