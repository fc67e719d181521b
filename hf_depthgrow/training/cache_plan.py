"""Whether `prefix_cache="auto"` builds the frozen-prefix cache: on only when it is predicted to save work.

The cache runs the frozen layers below the lowest trained block once per training (and held-out)
row, up front; afterwards every pass over those rows skips them. Without it, every pass runs them:
each training visit (a frozen prefix keeps no graph, so a visit costs one prefix forward either
way), the fallback rule's passes over the selection rows (the original and the trained model), and
each held-out evaluation (before, every `eval_steps`, after). Counting prefix passes per row:

    without cache:  V + 2 S + E n_eval        (V training visits, S selection rows, E held-out passes)
    with cache:     n_train + n_eval          (the build; reads from the cache are copies, not layers)

A single epoch with no held-out set and no fallback saves nothing (V = n_train) and pays the cache's
memory, which is what the first round measured ("the prefix cache only pays across epochs"). The
cache is chosen when it saves at least `MIN_SAVING` of the prefix work; reading a cached row is a
memory copy, which this margin covers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_SAVING = 0.10  # share of the uncached prefix work the cache must save to be worth its memory


@dataclass(frozen=True)
class CachePlan:
    """The predicted prefix work with and without the cache, in prefix passes over one row.

    Example:
        ```python
        >>> plan = plan_prefix_work(TrainConfig(max_steps=30, per_device_train_batch_size=4), n_train=40, n_eval=0)
        >>> plan.epochs, round(plan.saving, 2)
        (3.0, 0.67)
        ```
    """

    uncached: float
    cached: float
    epochs: float

    @property
    def saving(self) -> float:
        """Share of the uncached prefix work the cache saves (negative: it costs more than it saves)."""
        return 1.0 - self.cached / self.uncached if self.uncached else 0.0

    def reason(self) -> str:
        return (
            f"predicted prefix passes {self.uncached:,.0f} without the cache, {self.cached:,.0f} with it "
            f"({self.saving:+.0%} saved; {self.epochs:.2g} epoch(s))"
        )


def planned_steps(config, n_train: int, world: int) -> int:
    """Optimizer steps the trainer will run (`max_steps`, or from `num_train_epochs` as the trainer counts them)."""
    if config.max_steps > 0:
        return config.max_steps
    batches_per_epoch = max(1, n_train // (config.per_device_train_batch_size * world))
    return max(1, math.ceil(config.num_train_epochs * batches_per_epoch / config.gradient_accumulation_steps))


def plan_prefix_work(config, n_train: int, n_eval: int, world: int = 1) -> CachePlan:
    """Prefix passes a trainer with `config` runs over `n_train` training and `n_eval` held-out rows.

    Example:
        ```python
        >>> plan_prefix_work(TrainConfig(max_steps=4, per_device_train_batch_size=4, fallback=False), 16, 0).saving
        0.0
        ```
    """
    steps = planned_steps(config, n_train, world)
    visits = steps * config.gradient_accumulation_steps * config.per_device_train_batch_size * world
    selection = 0
    if config.fallback:
        selection = min(config.selection_max_examples or n_train, n_train)
    eval_passes = 0
    if n_eval:
        during = (steps - 1) // config.eval_steps if config.eval_steps else 0
        eval_passes = 2 + during  # before, during, after
    uncached = visits + 2 * selection + eval_passes * n_eval
    return CachePlan(uncached=float(uncached), cached=float(n_train + (n_eval if n_eval else 0)), epochs=visits / max(n_train, 1))


def choose_auto(config, n_train: int, n_eval: int, world: int = 1) -> tuple[bool, str]:
    """`(build the cache?, why)` for `prefix_cache="auto"` once the cache is possible at all.

    Example:
        ```python
        >>> choose_auto(TrainConfig(num_train_epochs=3, per_device_train_batch_size=4), 40, 0)[0]
        True
        ```
    """
    plan = plan_prefix_work(config, n_train, n_eval, world)
    use = plan.saving >= MIN_SAVING
    verdict = "built" if use else f"not built (saves less than {MIN_SAVING:.0%})"
    return use, f"prefix cache {verdict}: {plan.reason()}"
