"""Learning-rate schedules: transformers' own, plus the warmup-stable-decay arithmetic that budget sweeps share.

A warmup-stable-decay (WSD) run of `total` steps warms up linearly for `warmup` steps, holds the peak rate,
and decays (cosine, to zero) over its last `decay_steps(total, ratio)` steps. Two WSD runs with the same
warm-up and peak rate are identical until the shorter one starts decaying, which is what lets a budget
sweep train the stable phase once and branch a decay at each budget (`training.branching`): the branch
is the standalone run of that budget, step for step (transformers' `get_wsd_schedule` gives the rates).
"""

from __future__ import annotations

import math

import torch

SCHEDULERS = ("cosine", "linear", "constant", "wsd")


def decay_steps(total: int, ratio: float) -> int:
    """Steps of the decay phase of a WSD run of `total` steps (at least 1).

    Example:
        ```python
        >>> decay_steps(20, 0.2), decay_steps(160, 0.2), decay_steps(3, 0.2)
        (4, 32, 1)
        ```
    """
    return max(1, math.ceil(ratio * total))


def stable_end(total: int, ratio: float) -> int:
    """The last step of a WSD run's stable phase: a branch of budget `total` starts its decay after it."""
    return total - decay_steps(total, ratio)


def check_wsd(total: int, warmup: int, ratio: float) -> None:
    """A WSD run needs its warm-up to end before its decay starts."""
    if warmup > stable_end(total, ratio):
        raise ValueError(
            f"a warmup-stable-decay run of {total} steps decays over its last {decay_steps(total, ratio)}: "
            f"the warm-up ({warmup} steps) must end by step {stable_end(total, ratio)}"
        )


def build_scheduler(name: str, optimizer, *, warmup: int, total: int, decay_ratio: float = 0.2):
    """transformers' scheduler `name` (`"constant"` with warm-up; `"wsd"` decaying over `decay_ratio` of `total`)."""
    from transformers import get_scheduler, get_wsd_schedule

    if name == "wsd":
        check_wsd(total, warmup, decay_ratio)
        return get_wsd_schedule(optimizer, num_warmup_steps=warmup, num_decay_steps=decay_steps(total, decay_ratio), num_training_steps=total)
    sched_name = "constant_with_warmup" if name == "constant" else name
    return get_scheduler(sched_name, optimizer, num_warmup_steps=warmup, num_training_steps=total)


def wsd_lambdas(count: int, *, warmup: int, total: int, decay_ratio: float) -> list:
    """The per-group rate factors of a WSD run of `total` steps, to swap into a running `LambdaLR`.

    Built on a throw-away optimizer, so the running one's rates are not touched.
    """
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    lam = build_scheduler("wsd", dummy, warmup=warmup, total=total, decay_ratio=decay_ratio).lr_lambdas[0]
    return [lam] * count
