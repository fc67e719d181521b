"""Where to grow: the first-order signal of a zero-initialised block at every depth (THEORY §2, §5, §6).

For a candidate position k the grown model is `f_top(z + h_theta(z))` with `h_0 = 0`. At
`theta = 0` the model is unchanged, so the gradient of the training loss with respect to the
block's parameters is the vector-Jacobian product of the block output `z + h_theta(z)` with the
activation gradient `g = dl/dz` of the *original* model, and only the zeroed output projections
get a non-zero gradient. The probe therefore needs, per batch, one forward and one backward of
the original model (gradients with respect to activations only: no weight gradients) plus one
cheap forward of each candidate block on the captured `z`. From the per-batch gradients it
reports the empirical signal `||G_S(k)||_F`, an unbiased estimate of the population signal
`||G_D(k)||^2` with a standard error and z-score, the activation-gradient covariance statistics
and the norm regime at every position, and a recommendation.

Example:
    ```python
    >>> from hf_depthgrow.probe.signal import probe
    >>> result = probe(model, loader)  # loader yields dicts with labels
    >>> result.recommendation["positions"], result.z
    ```
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import asdict, dataclass, field
from itertools import islice
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from ..growth import adapter
from ..growth.families import FamilySpec, model_eps, resolve_family, residual_output_modules
from ..growth.engine import GrowthConfig, check_positions, resolve_block_kind, build_block
from ..utils import json_safe, package_version
from ..losses import example_losses, is_causal_lm, labels_of, model_inputs
from ..growth.norms import norm_eps, is_norm

__all__ = ["VERDICT_IMPROVABLE", "VERDICT_NOT_OBSERVABLE", "ProbeResult", "iter_batches", "probe"]

VERDICT_IMPROVABLE = "improvable"
VERDICT_NOT_OBSERVABLE = "not observable at this data size (deepest-model regime)"
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


# --------------------------------------------------------------------------- result


@dataclass
class ProbeResult:
    """What `probe` measured, one list entry per candidate position (aligned with `positions`).

    Signals:
        signal: `||G_S(k)||_F`, the norm of the gradient of the data-set loss with respect to all
            parameters of the block `grow_depth(model, [k], ...)` would insert, at zero init.
        signal_parts: The same norm per parameter of that block (only the zeroed output
            projections appear: every other parameter has an exactly zero gradient at init).
        population: Unbiased estimate of `||G_D(k)||^2` (the squared population signal): the
            mean of `<G_b, G_b'>` over pairs of distinct batches, weighted (it can be negative).
        population_se: Its standard error (delete-a-group jackknife over `num_splits` groups of batches).
        z: `population / population_se`.
        verdict: `"improvable"` where `z > z_threshold`, else
            `"not observable at this data size (deepest-model regime)"`.
        recommendation: `{"grow": bool, "positions": [...], "best": k or None, "reason": str}`.

    Covariance of the activation gradient (THEORY §5), `Sigma_k = E[g g^T]` over tokens, with `g`
    the gradient of the example's *summed* loss with respect to one token's residual vector:
        offdiag_share, spectral_norm, stable_rank, trace.

    Norm regime (THEORY §6):
        norm_eps: eps of the next norm (the first norm inside layer k; the final norm for k = L).
        near_singular_share: share of tokens with `var(z) <= norm_factor * norm_eps`.
        mean_var, min_var: mean and smallest `var(z)` over tokens (mean square for RMSNorm families).

    `gradients` (only with `keep_gradients=True`) holds `G_S(k)` per parameter name of the block;
    it is not part of `to_dict()`.
    """

    model_type: str
    num_layers: int
    block: str
    init: str
    seed: int
    eps: float | None
    adapter_dim: int | None
    adapter_act: str
    positions: list[int]
    signal: list[float]
    signal_parts: list[dict[str, float]]
    population: list[float]
    population_se: list[float]
    population_signal: list[float]
    z: list[float]
    verdict: list[str]
    improvable: list[bool]
    offdiag_share: list[float]
    spectral_norm: list[float]
    stable_rank: list[float]
    trace: list[float]
    norm_eps: list[float]
    near_singular_share: list[float]
    mean_var: list[float]
    min_var: list[float]
    loss: float
    num_batches: int
    num_examples: int
    total_weight: float
    weight_unit: str
    num_splits: int
    z_threshold: float
    norm_factor: float
    recommendation: dict
    hf_depthgrow_version: str = field(default_factory=package_version)
    gradients: list[dict[str, torch.Tensor]] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        """Plain JSON-able dict (non-finite numbers become `None`); gradients are left out."""
        data = asdict(self)
        data.pop("gradients", None)
        return json_safe(data, nonfinite="null")

    def to_json(self, path) -> None:
        """Write `to_dict()` as sorted, indented JSON."""
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2, sort_keys=True)
            handle.write("\n")

    @classmethod
    def from_dict(cls, data: dict) -> "ProbeResult":
        known = {f for f in cls.__dataclass_fields__ if f != "gradients"}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("z", "population", "population_se", "offdiag_share", "spectral_norm", "stable_rank", "trace"):
            if key in values:
                values[key] = [math.nan if v is None else v for v in values[key]]
        return cls(**values)

    @classmethod
    def from_json(cls, path) -> "ProbeResult":
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))

    def summary(self) -> str:
        """A fixed-width table, one row per position, and the recommendation."""
        lines = [
            f"{'k':>3} {'||G_S||':>10} {'pop^2':>11} {'se':>10} {'z':>7}  {'offdiag':>7} {'srank':>7} {'near-eps':>8}  verdict"
        ]
        for i, k in enumerate(self.positions):
            lines.append(
                f"{k:>3} {self.signal[i]:>10.3e} {self.population[i]:>11.3e} {self.population_se[i]:>10.3e} "
                f"{self.z[i]:>7.2f}  {self.offdiag_share[i]:>7.3f} {self.stable_rank[i]:>7.1f} "
                f"{self.near_singular_share[i]:>8.3f}  {self.verdict[i]}"
            )
        lines.append(f"recommendation: {self.recommendation['reason']}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- data


def iter_batches(data, *, collate_fn: Callable | None = None, batch_size: int = 8, max_batches: int | None = None) -> Iterator[dict]:
    """Batches (dicts of tensors with `labels`) from a DataLoader, an iterable of batches or a data set.

    A `datasets.Dataset` or a map-style `torch.utils.data.Dataset` is wrapped in a `DataLoader`
    (in order, `batch_size`, `collate_fn` defaulting to transformers' `default_data_collator`).
    """
    batches = _as_batches(data, collate_fn=collate_fn, batch_size=batch_size)
    return islice(iter(batches), max_batches) if max_batches is not None else iter(batches)


def _is_dataset(data) -> bool:
    if isinstance(data, (list, tuple, dict, torch.utils.data.DataLoader)):
        return False
    if isinstance(data, torch.utils.data.Dataset):
        return True
    try:
        import datasets

        return isinstance(data, datasets.Dataset)
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False


def _as_batches(data, *, collate_fn, batch_size):
    if isinstance(data, dict):
        return [data]  # one batch
    if _is_dataset(data):
        if collate_fn is None:
            from transformers import default_data_collator as collate_fn
        return torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=collate_fn)
    return data


def _num_batches(batches, max_batches: int | None) -> int | None:
    try:
        n = len(batches)
    except TypeError:
        return max_batches
    return n if max_batches is None else min(n, max_batches)


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# --------------------------------------------------------------------------- capture on the original model


class _Tap:
    """Hooks on the original layers: capture `z` at the wanted positions and every layer's call arguments.

    Where a captured `z` is not yet part of an autograd graph (the parameters are frozen during the
    probe), it is replaced by an identical leaf that requires grad, so that one backward gives
    `dl/dz` at every position and nothing upstream of the first wanted position is differentiated.
    """

    def __init__(self, stack: nn.ModuleList, z_positions: set[int], call_layers: set[int], *, before_adapters: bool):
        self.num_layers = len(stack)
        self.z: dict[int, torch.Tensor] = {}
        self.calls: dict[int, tuple[tuple, dict]] = {}
        self.handles = []
        for i, layer in enumerate(stack):
            if i in z_positions or i in call_layers:
                hook = self._pre(i, i in z_positions, i in call_layers)
                # A native block goes into the layer list before layer k, so ahead of adapter blocks
                # already hung on layer k's input; a new adapter block is appended after them.
                self.handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True, prepend=before_adapters))
        if self.num_layers in z_positions:
            self.handles.append(stack[-1].register_forward_hook(self._post))

    def _pre(self, index: int, want_z: bool, want_call: bool):
        def hook(module, args, kwargs):
            by_kwarg = not args
            hidden = kwargs["hidden_states"] if by_kwarg else args[0]
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            if want_call:
                self.calls[index] = (tuple(args[1:]), rest)
            if not want_z:
                return None
            if hidden.requires_grad:
                self.z[index] = hidden
                return None
            hidden = hidden.detach().requires_grad_(True)
            self.z[index] = hidden
            if by_kwarg:
                return args, {**kwargs, "hidden_states": hidden}
            return (hidden, *args[1:]), kwargs

        return hook

    def _post(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            self.z[self.num_layers] = hidden
            return None
        hidden = hidden.detach().requires_grad_(True)
        self.z[self.num_layers] = hidden
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    def clear(self) -> None:
        self.z, self.calls = {}, {}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _scrub_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Call arguments of an original layer, made safe for a candidate layer: no KV cache."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover
        Cache = ()
    args = tuple(None if isinstance(a, Cache) else a for a in args)
    kwargs = dict(kwargs)
    for key in _CACHE_KWARGS:
        if key in kwargs:
            kwargs[key] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


# --------------------------------------------------------------------------- candidate blocks


def _detach_input(module, args, kwargs):
    # Cut the graph at the zeroed projection's input: a path through it carries `grad @ W = 0`
    # at zero init, so dropping it is exact and spares backpropagating through the block's MLP.
    if args:
        return (args[0].detach(), *args[1:]), kwargs
    for key in ("input", "hidden_states", "x"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: kwargs[key].detach()}
    return None


class _Candidate:
    """The block `grow_depth(model, [k], ...)` would insert, prepared for the VJP at `z`."""

    def __init__(self, model: nn.Module, stack: nn.ModuleList, spec: FamilySpec, position: int, cfg: GrowthConfig):
        self.position = position
        self.kind, self.module = build_block(model, position, cfg)
        self.module.eval()
        if self.kind == "native":
            outputs = residual_output_modules(spec, self.module)
        else:
            outputs = [self.module.w_out]
        # The native block copies layer k-1 and takes its per-layer config entries (attention
        # type, sliding window), so it is called with the arguments layer k-1 receives.
        self.source = max(position - 1, 0) if self.kind == "native" else None
        ids = {id(p) for m in outputs for p in m.parameters(recurse=False)}
        self.names = [n for n, p in self.module.named_parameters() if id(p) in ids]
        self.params = [self.module.get_parameter(n) for n in self.names]
        for p in self.module.parameters():
            p.requires_grad_(id(p) in ids)
        self.shapes = [p.shape for p in self.params]
        self.numel = sum(p.numel() for p in self.params)
        self.handles = [m.register_forward_pre_hook(_detach_input, with_kwargs=True) for m in outputs]

    def gradient(self, z: torch.Tensor, g: torch.Tensor, call: tuple[tuple, dict] | None) -> list[torch.Tensor]:
        """Gradient of `<g, block(z)>` per output parameter: the VJP with upstream `g`."""
        z = z.detach()
        with torch.enable_grad():
            if self.kind == "native":
                args, kwargs = _scrub_cache(*call)
                out = self.module(z, *args, **kwargs)
            else:
                out = self.module(z)
            out = out[0] if isinstance(out, tuple) else out
            grads = torch.autograd.grad(out, self.params, grad_outputs=g, allow_unused=True)
        return [torch.zeros_like(p) if gr is None else gr for gr, p in zip(grads, self.params)]

    def unflatten(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name, shape in zip(self.names, self.shapes):
            n = math.prod(shape)
            out[name] = vector[start : start + n].view(shape).clone()
            start += n
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


# --------------------------------------------------------------------------- streaming statistics


class _Stats:
    """Per-position running sums; memory `num_splits x (block output parameters) + d x d`.

    Batch b contributes its summed-loss gradient `S_b` and weight `w_b` (supervised tokens or
    examples). `G_S = sum_b S_b / sum_b w_b`. With independent batches and `E[S_b | w_b] = w_b mu`,
    `U = (||sum_b S_b||^2 - sum_b ||S_b||^2) / ((sum_b w_b)^2 - sum_b w_b^2)` is unbiased for
    `||mu||^2 = ||G_D||^2`: the weighted mean of `<G_b, G_b'>` over pairs b != b'. Batches are dealt
    round-robin into groups whose sums are kept for a delete-a-group jackknife.
    """

    def __init__(self, numel: int, num_splits: int, device, covariance: bool):
        # Group sums, allocated on first use (a short run does not pay for unused groups).
        self.numel, self.device = numel, device
        self.groups: list[torch.Tensor | None] = [None] * num_splits
        self.group_sq = [0.0] * num_splits  # sum of ||S_b||^2 per group
        self.group_w = [0.0] * num_splits
        self.group_w2 = [0.0] * num_splits
        self.group_n = [0] * num_splits
        self.want_cov = covariance
        self.cov: torch.Tensor | None = None  # allocated on the first batch, d x d
        self.tokens = 0
        self.near = 0
        self.var_sum = 0.0
        self.var_min = math.inf

    def add_gradient(self, batch_index: int, grads: list[torch.Tensor] | torch.Tensor, weight: float) -> None:
        m = batch_index % len(self.groups)
        if self.groups[m] is None:
            self.groups[m] = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        start, sq = 0, 0.0
        for grad in [grads] if isinstance(grads, torch.Tensor) else grads:
            flat = grad.reshape(-1).float()
            self.groups[m][start : start + flat.numel()] += flat
            # Sum of squares in fp32 is accurate to ~1e-6 relative, far below the statistical error.
            sq += float(torch.dot(flat, flat))
            start += flat.numel()
        self.group_sq[m] += sq
        self.group_w[m] += weight
        self.group_w2[m] += weight * weight
        self.group_n[m] += 1

    def add_tokens(self, g_rows: torch.Tensor | None, var: torch.Tensor, near_limit: float) -> None:
        if self.want_cov and g_rows is not None:
            g32 = g_rows.float()
            if self.cov is None:
                self.cov = torch.zeros(g32.shape[-1], g32.shape[-1], dtype=torch.float64, device=g32.device)
            self.cov += (g32.T @ g32).double()
        self.tokens += var.numel()
        self.near += int((var <= near_limit).sum())
        if var.numel():
            self.var_sum += float(var.double().sum())
            self.var_min = min(self.var_min, float(var.min()))

    def total(self) -> torch.Tensor:
        used = [g for g in self.groups if g is not None]
        return torch.stack(used).sum(dim=0) if used else torch.zeros(self.numel, device=self.device)

    def population(self) -> tuple[float, float]:
        """`(U, jackknife standard error)`; NaN where there are too few batches."""
        used = [m for m in range(len(self.groups)) if self.group_n[m] > 0]
        if not used:
            return math.nan, math.nan
        stacked = torch.stack([self.groups[m] for m in used]).double()
        gram = (stacked @ stacked.T).cpu()
        del stacked
        sq = torch.tensor([self.group_sq[m] for m in used], dtype=torch.float64)
        w = torch.tensor([self.group_w[m] for m in used], dtype=torch.float64)
        w2 = torch.tensor([self.group_w2[m] for m in used], dtype=torch.float64)
        u = _u_stat(gram.sum(), sq.sum(), w.sum(), w2.sum())
        if len(used) < 2:
            return u, math.nan
        row = gram.sum(dim=1)
        total = gram.sum()
        leave = [
            _u_stat(total - 2 * row[m] + gram[m, m], sq.sum() - sq[m], w.sum() - w[m], w2.sum() - w2[m]) for m in range(len(used))
        ]
        if any(math.isnan(v) for v in leave):
            return u, math.nan
        n = len(leave)
        mean = sum(leave) / n
        se = math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in leave))
        return u, se

    def covariance(self) -> dict[str, float]:
        nan = dict(offdiag_share=math.nan, spectral_norm=math.nan, stable_rank=math.nan, trace=math.nan)
        if self.cov is None or self.tokens == 0:
            return nan
        sigma = (self.cov / self.tokens).cpu()
        sigma = (sigma + sigma.T) / 2
        fro = float(torch.linalg.matrix_norm(sigma))
        trace = float(torch.trace(sigma))
        if fro == 0.0:
            return dict(offdiag_share=0.0, spectral_norm=0.0, stable_rank=math.nan, trace=0.0)
        off = float(torch.linalg.matrix_norm(sigma - torch.diag(torch.diag(sigma))))
        top = _top_eigenvalue(sigma)
        return dict(offdiag_share=off / fro, spectral_norm=top, stable_rank=trace / top if top > 0 else math.nan, trace=trace)


def _top_eigenvalue(sigma: torch.Tensor, *, max_iter: int = 50, tol: float = 1e-7) -> float:
    """Largest eigenvalue of a symmetric PSD matrix.

    Power iteration from a fixed random start, stopped once the residual `||S x - lam x||` is below
    `tol * lam` (then `lam` is within that of an eigenvalue, and the start makes it the top one): a
    few matrix-vector products where the top eigenvalue stands out. Otherwise the exact solver, on
    one thread: a threaded symmetric eigensolver syncs at every small step and can take seconds for
    d ~ 600 on a busy CPU.
    """
    n = sigma.shape[0]
    x = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=sigma.dtype).to(sigma.device)
    x = x / x.norm()
    for _ in range(max_iter):
        y = sigma @ x
        lam = float(x @ y)
        if lam <= 0:
            break
        if float((y - lam * x).norm()) <= tol * lam:
            return lam
        x = y / y.norm()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return float(torch.linalg.eigvalsh(sigma)[-1])
    finally:
        torch.set_num_threads(threads)


def _u_stat(sum_sq_total, sum_sq_batches, w, w2) -> float:
    denom = float(w) ** 2 - float(w2)
    if denom <= 0:
        return math.nan
    return (float(sum_sq_total) - float(sum_sq_batches)) / denom


# --------------------------------------------------------------------------- norms


def _next_norm_eps(model: nn.Module, spec: FamilySpec, stack: nn.ModuleList, position: int) -> float:
    """eps of the norm that next sees the residual stream at `position` (see `ProbeResult`)."""
    fallback = model_eps(spec, model.config) or 1e-6
    if position < len(stack):
        for name, module in stack[position].named_modules():
            if name.startswith((adapter.PRE, adapter.POST)):
                continue
            if is_norm(module) and norm_eps(module) is not None:
                return norm_eps(module)
        return fallback
    # k = L: the first norm registered after the layer stack in the base model (the final norm).
    base = getattr(model, "base_model", model)
    after, stack_seen = None, False
    stack_ids = {id(m) for m in stack.modules()}
    for _, module in base.named_modules():
        if module is stack:
            stack_seen = True
            continue
        if stack_seen and id(module) not in stack_ids and is_norm(module) and norm_eps(module) is not None:
            after = norm_eps(module)
            break
    return after if after is not None else fallback


def _token_var(z: torch.Tensor, norm: str) -> torch.Tensor:
    z32 = z.detach().float()
    return z32.square().mean(dim=-1) if norm == "rms" else z32.var(dim=-1, unbiased=False)


# --------------------------------------------------------------------------- probe


def _token_mask(batch: dict, z: torch.Tensor) -> torch.Tensor | None:
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tuple(mask.shape) == tuple(z.shape[:2]):
        return mask.to(z.device).bool()
    return None


def _recommend(positions, z, improvable, top: int = 3) -> dict:
    ranked = sorted((i for i in range(len(positions)) if improvable[i]), key=lambda i: -z[i])
    if not ranked:
        return {
            "grow": False,
            "positions": [],
            "best": None,
            "reason": "do not grow: no position's population signal is significantly positive at this data size "
            "(deepest-model regime). Depth is not expected to help unless width or data grows.",
        }
    best = positions[ranked[0]]
    chosen = [positions[i] for i in ranked[:top]]
    return {
        "grow": True,
        "positions": chosen,
        "best": best,
        "reason": f"grow at k={best} (largest z-score, z={z[ranked[0]]:.2f}); improvable positions by z: {chosen}",
    }


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
    z_threshold: float = 2.0,
    norm_factor: float = 100.0,
    covariance: bool = True,
    max_batches: int | None = None,
    collate_fn: Callable | None = None,
    batch_size: int = 8,
    keep_gradients: bool = False,
    progress: bool = True,
) -> ProbeResult:
    """Measure, for every candidate depth k, whether a zero-initialised block there can lower the loss.

    `signal[i] = ||G_S(k)||_F` is the Frobenius norm of the gradient of the training loss with
    respect to all parameters of the block that `grow_depth(model, [k], block=block, init=init,
    seed=seed, eps=eps, adapter_dim=adapter_dim, adapter_act=adapter_act)` would insert, at its
    zero init. The training loss is the model's own head loss (`hf_depthgrow.losses`) averaged over
    the whole of `data`: token-weighted for causal LMs (total loss over all supervised tokens
    divided by their number), per example for classifiers. It equals what autograd gives on the
    grown model, but all positions come from one forward and one backward of the original model
    per batch, with no weight gradients of the model.

    The population signal `||G_D(k)||^2` is estimated without bias as the (weighted) mean of
    `<G_b, G_b'>` over pairs of distinct batches, which requires batches to be independent
    samples; its standard error comes from a delete-a-group jackknife over `num_splits` groups of
    batches (dealt round-robin). `z = estimate / se`; a position is `"improvable"` where
    `z > z_threshold`, otherwise its signal is "not observable at this data size (deepest-model
    regime)". At least 3 batches are needed for a standard error; more than `2 * num_splits` is
    better.

    The model is run in eval mode (dropout off); training flags, `requires_grad` and `.grad` are
    left as they were and every hook is removed, also on error.

    Args:
        model: A transformers model with a head: `*ForCausalLM`, `*ForSequenceClassification` or
            `*ForImageClassification` of a family `grow_depth` supports.
        data: A `DataLoader` or any iterable of batches (dicts of tensors with `labels`), one
            batch dict, or a `datasets.Dataset` / map-style dataset (batched with `batch_size`
            and `collate_fn`, default transformers' `default_data_collator`).
        positions: Candidate positions, 0 <= k <= L; default all of `0..L`. Sorted, duplicates dropped.
        block, init, seed, eps, adapter_dim, adapter_act: As in `GrowthConfig`; they decide
            which block is probed at each position.
        num_splits: Number of batch groups for the jackknife standard error.
        z_threshold: z-score above which a position is called improvable.
        norm_factor: A token is near-singular for the next norm when `var(z) <= norm_factor * eps`.
        covariance: Accumulate `Sigma_k = E[g g^T]` (a `d x d` matrix per position).
        max_batches: Stop after this many batches.
        collate_fn, batch_size: Used only when `data` is a dataset.
        keep_gradients: Keep `G_S(k)` per block parameter in `result.gradients` (for stepping stones).
        progress: Show a tqdm progress bar.

    Returns:
        A `ProbeResult`.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
        >>> model = tiny_model("llama")
        >>> batches = [tiny_inputs(model, seed=s) for s in range(6)]
        >>> result = probe(model, batches, progress=False)
        >>> len(result.signal) == model.config.num_hidden_layers + 1
        True
        ```
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 2:
        raise ValueError(f"num_splits must be an int >= 2, got {num_splits!r}")
    if not norm_factor > 0:
        raise ValueError(f"norm_factor must be > 0, got {norm_factor!r}")
    cfg = GrowthConfig(block=block, init=init, eps=eps, seed=seed, adapter_dim=adapter_dim, adapter_act=adapter_act)
    spec, stack, _ = resolve_family(model)
    num_layers = len(stack)
    positions = sorted(set(check_positions(list(range(num_layers + 1)) if positions is None else positions, num_layers)))
    kind = resolve_block_kind(cfg, spec, model.config)
    own_eps = model_eps(spec, model.config)
    if kind == "native" and eps is not None and own_eps is not None and eps != own_eps:
        raise ValueError(
            f"native blocks use the family's norms with the config's eps ({own_eps}); use block='adapter' for a block with eps={eps}."
        )
    causal = is_causal_lm(model)
    candidates = [_Candidate(model, stack, spec, k, cfg) for k in positions]
    device = candidates[0].params[0].device
    stats = [_Stats(c.numel, num_splits, device, covariance) for c in candidates]
    norm_eps = [_next_norm_eps(model, spec, stack, k) for k in positions]
    call_layers = {c.source for c in candidates if c.source is not None}
    forward_params = inspect.signature(model.forward).parameters
    extra = {"use_cache": False} if "use_cache" in forward_params else {}

    # Frozen parameters: the backward then computes activation gradients only.
    flags = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    tap = None
    total_loss, total_weight, num_examples, num_batches = 0.0, 0.0, 0, 0
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        model.eval()
        tap = _Tap(stack, set(positions), call_layers, before_adapters=kind == "native")
        batches = _as_batches(data, collate_fn=collate_fn, batch_size=batch_size)
        total = _num_batches(batches, max_batches)
        iterator = islice(iter(batches), max_batches) if max_batches is not None else iter(batches)
        from tqdm.auto import tqdm

        for b, batch in enumerate(tqdm(iterator, total=total, disable=not progress, desc="probe", unit="batch")):
            batch = _to_device(batch, device)
            labels = labels_of(batch)
            tap.clear()
            with torch.enable_grad():
                outputs = model(**model_inputs(batch), **extra)
                losses = example_losses(outputs.logits, labels, causal=causal)
                loss_sum = losses.total.sum()
                weight = float(losses.weight.sum())
                zs = [tap.z.get(k) for k in positions]
                missing = [k for k, z in zip(positions, zs) if z is None]
                if missing:  # pragma: no cover - guarded by the hooks
                    raise RuntimeError(f"no residual stream captured at positions {missing}")
                gs = torch.autograd.grad(loss_sum, zs, allow_unused=True)
            del outputs
            total_loss += float(loss_sum.detach())
            total_weight += weight
            num_examples += int(labels.shape[0])
            num_batches += 1
            for i, (cand, z, g) in enumerate(zip(candidates, zs, gs)):
                g = torch.zeros_like(z) if g is None else g
                call = tap.calls.get(cand.source) if cand.source is not None else None
                stats[i].add_gradient(b, cand.gradient(z, g, call), weight)
                mask = _token_mask(batch, z)
                g_rows = g.reshape(-1, g.shape[-1]) if mask is None else g[mask]
                var = _token_var(z, spec.norm)
                var = var.reshape(-1) if mask is None else var[mask]
                stats[i].add_tokens(g_rows, var, norm_factor * norm_eps[i])
            tap.clear()
    finally:
        if tap is not None:
            tap.remove()
        for cand in candidates:
            cand.close()
        for p, flag in flags:
            p.requires_grad_(flag)
        for m, mode in modes:
            m.training = mode

    if num_batches == 0:
        raise ValueError("data yielded no batches")
    weight_unit = "supervised tokens" if causal else "examples"
    result = _assemble(
        model, spec, kind, cfg, positions, candidates, stats, norm_eps, total_loss, total_weight, num_examples, num_batches,
        num_splits, z_threshold, norm_factor, weight_unit, keep_gradients,
    )
    return result


def _assemble(model, spec, kind, cfg, positions, candidates, stats, norm_eps, total_loss, total_weight, num_examples, num_batches,
              num_splits, z_threshold, norm_factor, weight_unit, keep_gradients) -> ProbeResult:
    signal, parts, pop, se, pop_signal, zs, verdict, improvable = [], [], [], [], [], [], [], []
    cov_rows, near, mean_var, min_var, grads = [], [], [], [], []
    for cand, st in zip(candidates, stats):
        g_total = st.total() / max(total_weight, 1e-300)
        signal.append(float(g_total.double().norm()))
        per_param = cand.unflatten(g_total)
        parts.append({name: float(t.double().norm()) for name, t in per_param.items()})
        if keep_gradients:
            grads.append(per_param)
        u, s = st.population()
        pop.append(u)
        se.append(s)
        pop_signal.append(math.sqrt(u) if u > 0 else 0.0)
        if math.isnan(u) or math.isnan(s):
            z = math.nan
        elif s > 0:
            z = u / s
        else:
            z = 0.0 if u <= 0 else math.inf
        zs.append(z)
        ok = not math.isnan(z) and z > z_threshold
        improvable.append(ok)
        verdict.append(VERDICT_IMPROVABLE if ok else VERDICT_NOT_OBSERVABLE)
        cov_rows.append(st.covariance())
        near.append(st.near / st.tokens if st.tokens else math.nan)
        mean_var.append(st.var_sum / st.tokens if st.tokens else math.nan)
        min_var.append(st.var_min if st.tokens else math.nan)
    block_eps = cfg.eps if cfg.eps is not None else model_eps(spec, model.config)
    return ProbeResult(
        model_type=str(getattr(model.config, "model_type", "")),
        num_layers=model.config.num_hidden_layers,
        block=kind,
        init=cfg.init if kind == "native" else "random",
        seed=cfg.seed,
        eps=block_eps,
        adapter_dim=cfg.adapter_dim,
        adapter_act=cfg.adapter_act,
        positions=list(positions),
        signal=signal,
        signal_parts=parts,
        population=pop,
        population_se=se,
        population_signal=pop_signal,
        z=zs,
        verdict=verdict,
        improvable=improvable,
        offdiag_share=[r["offdiag_share"] for r in cov_rows],
        spectral_norm=[r["spectral_norm"] for r in cov_rows],
        stable_rank=[r["stable_rank"] for r in cov_rows],
        trace=[r["trace"] for r in cov_rows],
        norm_eps=norm_eps,
        near_singular_share=near,
        mean_var=mean_var,
        min_var=min_var,
        loss=total_loss / max(total_weight, 1e-300),
        num_batches=num_batches,
        num_examples=num_examples,
        total_weight=total_weight,
        weight_unit=weight_unit,
        num_splits=num_splits,
        z_threshold=z_threshold,
        norm_factor=norm_factor,
        recommendation=_recommend(list(positions), zs, improvable),
        gradients=grads if keep_gradients else None,
    )


# --------------------------------------------------------------------------- plot


