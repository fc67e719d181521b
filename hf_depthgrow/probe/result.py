"""What the probe reports: `ProbeResult`, its verdicts and its recommendation (docs/theory.md §2, §5, §6).

Example:
    ```python
    >>> from hf_depthgrow.probe.result import ProbeResult
    >>> result = ProbeResult.from_json("runs/x/probe/probe.json")
    >>> print(result.summary())
    ```
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import torch

from ..utils import json_safe, package_version

__all__ = ["VERDICT_IMPROVABLE", "VERDICT_NOT_OBSERVABLE", "ProbeResult", "Z_THRESHOLD", "recommend", "threshold_note"]

# "Improvable" where z > Z_THRESHOLD. Calibrated on the scaling study's 54 cells against a certified test
# gain after training the block (`python -m hf_depthgrow.scaling.calibration docs/scaling/cells`): at
# z > 2 the verdict agreed with the outcome in 52% (LM) and 30% (ViT) of cells, at z > -1 in 81% and
# 78%; chosen leave-one-task-out, each task's threshold from the other task's cells (-1 and -2), the
# larger of the two taken. A verdict about what training will realize, not a test of the first-order
# signal: that is z itself, still reported.
Z_THRESHOLD = -1.0

VERDICT_IMPROVABLE = "improvable"
VERDICT_NOT_OBSERVABLE = "not observable at this data size (deepest-model regime)"


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

    Covariance of the activation gradient (docs/theory.md §5), `Sigma_k = E[g g^T]` over tokens, with `g`
    the gradient of the example's *summed* loss with respect to one token's residual vector:
        offdiag_share, spectral_norm, stable_rank, trace.

    Norm regime (docs/theory.md §6):
        norm_eps: eps of the next norm (the first norm inside layer k; the final norm for k = L).
        near_singular_share: share of tokens with `var(z) <= norm_factor * norm_eps`.
        mean_var, min_var: mean and smallest `var(z)` over tokens (mean square for RMSNorm families).

    `stopping`: where sequential stopping (`probe(..., stop_patience=N)`) ended the probe, else `None`;
    `recommendation_trace` (with `stop_patience` only): after each batch from the 3rd, `{"batches", "grow",
    "positions", "median_se"}`: the recommendation the stop watched and the median standard error of z.

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
    stopping: str | None = None
    recommendation_trace: list[dict] | None = None
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
        lines.append(f"verdict: {threshold_note(self.z_threshold)}")
        lines.append(f"recommendation: {self.recommendation['reason']}")
        from .placement_policy import DEFAULT_TRACK_RECORD, track_record_line

        if self.recommendation.get("policy") == DEFAULT_TRACK_RECORD["policy"]:
            lines.append(track_record_line())
        return "\n".join(lines)


def threshold_note(z_threshold: float) -> str:
    """What the z threshold of the verdict (and the dashed line of the probe plot) is, in one sentence.

    Example:
        ```python
        >>> threshold_note(-1.0)[:40]
        '"improvable" where z > -1: the default t'
        ```
    """
    if z_threshold == Z_THRESHOLD:
        return (
            f'"improvable" where z > {z_threshold:g}: the default threshold, calibrated against certified test gains after '
            "training a block on the scaling study's 54 cells (leave-one-task-out; docs/probe.md). It predicts what training "
            "will realize; z itself is the strength of the first-order evidence (z > 2 was the one-sided test of it)."
        )
    return f'"improvable" where z > {z_threshold:g}, the z_threshold of this probe (the calibrated default is {Z_THRESHOLD:g}; docs/probe.md).'


def recommend(positions: list[int], z: list[float], improvable: list[bool], top: int = 3, *, policy: str | None = None,
              signal: list[float] | None = None, num_layers: int | None = None) -> dict:
    """The `recommendation` of a probe: grow at the (up to `top`) improvable positions, best first by the placement policy.

    Whether to grow is the probe's verdict (some position improvable); where is `policy` (default
    `placement_policy.DEFAULT_PLACEMENT`, the policy with the smallest worst-case regret on the committed oracle
    sweeps), ties to the lower position. The dict's `policy` names it.

    Example:
        ```python
        >>> recommend([0, 1, 2], [0.5, 3.0, 2.5], [False, True, True])["positions"]
        [1, 2]
        ```
    """
    from .placement_policy import DEFAULT_PLACEMENT, probe_policy_scores

    policy = DEFAULT_PLACEMENT if policy is None else policy
    scores = probe_policy_scores(policy, positions, z=z, signal=signal, num_layers=num_layers)
    ranked = sorted((i for i in range(len(positions)) if improvable[i]), key=lambda i: (-scores[i], positions[i]))
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
    why = f"largest z-score, z={z[ranked[0]]:.2f}" if policy == "z" else f"placement policy {policy}; z={z[ranked[0]]:.2f}"
    return {
        "grow": True,
        "positions": chosen,
        "best": best,
        "policy": policy,
        "reason": f"grow at k={best} ({why}); improvable positions by {policy}: {chosen}",
    }
