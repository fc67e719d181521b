"""Streamed per-position statistics of the probe: the U-statistic for `||G_D(k)||^2` with its delete-a-group
jackknife standard error, the activation-gradient covariance and the norm regime (docs/theory.md §2, §5, §6).

Example:
    ```python
    >>> from hf_depthgrow.probe.statistics import PositionStats
    >>> stats = PositionStats(5, num_splits=3, device="cpu", covariance=False)
    >>> for b in range(6):
    ...     stats.add_gradient(b, torch.randn(5) + 1.0, weight=1.0)
    >>> u, se = stats.population()
    ```
"""

from __future__ import annotations

import math

import torch

__all__ = ["PositionStats", "token_mask", "token_var", "top_eigenvalue", "u_statistic"]


class PositionStats:
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
        u = u_statistic(gram.sum(), sq.sum(), w.sum(), w2.sum())
        if len(used) < 2:
            return u, math.nan
        row = gram.sum(dim=1)
        total = gram.sum()
        leave = [
            u_statistic(total - 2 * row[m] + gram[m, m], sq.sum() - sq[m], w.sum() - w[m], w2.sum() - w2[m]) for m in range(len(used))
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
        top = top_eigenvalue(sigma)
        return dict(offdiag_share=off / fro, spectral_norm=top, stable_rank=trace / top if top > 0 else math.nan, trace=trace)


def top_eigenvalue(sigma: torch.Tensor, *, max_iter: int = 50, tol: float = 1e-7) -> float:
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


def u_statistic(sum_sq_total, sum_sq_batches, w, w2) -> float:
    """`(||sum_b S_b||^2 - sum_b ||S_b||^2) / ((sum_b w_b)^2 - sum_b w_b^2)`; NaN with fewer than two batches.

    Example:
        ```python
        >>> u_statistic(9.0, 5.0, 2.0, 2.0)  # two batches of weight 1: <S_1, S_2> = 2
        2.0
        ```
    """
    denom = float(w) ** 2 - float(w2)
    if denom <= 0:
        return math.nan
    return (float(sum_sq_total) - float(sum_sq_batches)) / denom


def token_var(z: torch.Tensor, norm: str) -> torch.Tensor:
    """Per-token variance of `z` over the hidden size (the mean square for RMSNorm families, `norm="rms"`).

    Example:
        ```python
        >>> token_var(torch.ones(2, 3, 4), "rms").shape
        torch.Size([2, 3])
        ```
    """
    z32 = z.detach().float()
    return z32.square().mean(dim=-1) if norm == "rms" else z32.var(dim=-1, unbiased=False)


def token_mask(batch: dict, z: torch.Tensor) -> torch.Tensor | None:
    """The batch's attention mask as booleans where it matches `z`'s `[batch, tokens]`, else `None` (all tokens).

    Example:
        ```python
        >>> token_mask({"attention_mask": torch.tensor([[1, 0]])}, torch.zeros(1, 2, 4)).tolist()
        [[True, False]]
        ```
    """
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tuple(mask.shape) == tuple(z.shape[:2]):
        return mask.to(z.device).bool()
    return None
