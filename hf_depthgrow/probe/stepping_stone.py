"""Stepping-stone ("jumpboard") models (docs/theory.md §3): one first-order step of a new block from zero.

`f~ = f_{theta = eta v}` with `v = -G / ||G||`, where `G` is the probe's gradient of the new
block's parameters at zero init. With `G` from the training data this is the training stepping
stone `f~_S`, whose loss is `L_S(f_old) - eta ||G_S|| + O(eta^2)`; with `G` from a held-out
split it is the population stepping stone `f~_pop`. `eta` comes from a short line search on the
training loss. Only the zero-initialised output parameters move, and the result is a real grown
model (`grow_depth`), so it saves with `save_pretrained` like any other.

Cost: the line search evaluates the training loss at ~10 step sizes, but nothing below the new
block changes with `eta`, so the residual stream entering it is computed once per batch
(`prefix.prefix_hidden`) and every evaluation runs only the layers from the block up
(`prefix.start_at`; `line_search.TrainingLoss`). A probe run with `keep_gradients=True` can hand over
`G_S` (`gradient=`), which saves the probe pass over the training data, and `stepping_stones` makes
`f~_S` and `f~_pop` from one set-up: one prefix, one `L_S(f_old)`, one `G_S` for both.

Example:
    ```python
    >>> from hf_depthgrow.probe.stepping_stone import stepping_stone
    >>> stone, info = stepping_stone(model, 3, train_loader)
    >>> info.loss_old, info.loss_stone, info.eta
    ```
"""

from __future__ import annotations

import copy
import inspect
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Sequence

import torch
from torch import nn

from ..data.batches import as_batches
from ..data.checks import check_batch
from ..growth.config import GrowthConfig
from ..growth.engine import grow_depth
from ..growth.checks import resolve_block_kind
from ..growth.towers import resolve_family
from ..losses import is_causal_lm, labels_of
from ..utils import json_safe, package_version
from .line_search import choose_eta
from .signal import NO_SUPERVISION, probe, supervised_units

__all__ = ["SteppingStoneResult", "rebuild_stepping_stone", "stepping_stone", "stepping_stones"]

@dataclass
class SteppingStoneResult:
    """What `stepping_stone` did and measured.

    Args:
        position: Where the block was inserted (counts the original layers).
        block: `native` or `adapter`.
        direction: `"train"` (`f~_S`) or `"held-out"` (`f~_pop`): the data `G` came from.
        eta: Chosen step, `||theta||_F` (0 when no step lowered the training loss).
        grad_norm: `||G||_F` of the direction's data.
        slope: Directional derivative of the training loss along `v`, `<G_S, v>`
            (`-grad_norm` for a training direction).
        loss_old: `L_S(f_old)`: training loss of the grown model at zero init (= the original).
        loss_stone: `L_S(f~)` at `eta`.
        predicted_first_order: `loss_old + eta * slope` (`L_S(f_old) - eta ||G_S||` for `f~_S`).
        line_search: Every `(eta, training loss)` evaluated, in order.
    """

    position: int
    block: str
    direction: str
    eta: float
    grad_norm: float
    slope: float
    loss_old: float
    loss_stone: float
    predicted_first_order: float
    line_search: list[tuple[float, float]]
    num_batches: int
    config: dict
    hf_depthgrow_version: str = field(default_factory=package_version)
    gradient: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def loss_drop(self) -> float:
        return self.loss_old - self.loss_stone

    def to_dict(self) -> dict:
        """Plain JSON-able dict (non-finite numbers become `None`); `gradient` is left out."""
        # Not `asdict(self)`: it would deep-copy the gradient only to drop it.
        data = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "gradient"}
        data["loss_drop"] = self.loss_drop
        data["line_search"] = [list(p) for p in self.line_search]
        return json_safe(data, nonfinite="null")

    @classmethod
    def from_dict(cls, data: dict) -> "SteppingStoneResult":
        """The result `to_dict` wrote (without `gradient`)."""
        known = {f for f in cls.__dataclass_fields__ if f != "gradient"}
        values = {k: v for k, v in data.items() if k in known}
        values["line_search"] = [tuple(p) for p in values.get("line_search", [])]
        return cls(**values)

    def to_json(self, path) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2, sort_keys=True)
            handle.write("\n")


def _check_search(etas, expand) -> None:
    if etas is not None and (not len(etas) or any(not (e > 0 and math.isfinite(e)) for e in etas)):
        raise ValueError(f"etas must be positive finite numbers, got {etas!r}")
    if expand <= 1:
        raise ValueError(f"expand must be > 1, got {expand}")


def _check_train_batches(model: nn.Module, batches: list[dict]) -> None:
    """Every training batch scoreable, and some token supervised, before the probe or any copy of the model."""
    if not batches:
        raise ValueError("train_data yielded no batches")
    for index, batch in enumerate(batches):
        check_batch(model, batch, where=f"train_data (batch {index})")
    causal = is_causal_lm(model)
    if sum(supervised_units(labels_of(b), causal) for b in batches) == 0:
        raise ValueError(NO_SUPERVISION.replace("the probe data", "train_data"))


def _check_gradient(gradient) -> None:
    if not isinstance(gradient, dict) or not gradient:
        raise ValueError("gradient must be a non-empty dict of parameter name -> tensor (probe(..., keep_gradients=True))")
    bad = sorted(n for n, t in gradient.items() if not bool(torch.isfinite(torch.as_tensor(t)).all()))
    if bad:
        raise ValueError(f"gradient has non-finite values in {bad[:4]}: the probe that gave it saw NaN or inf")


def _gradients(model, position, batches, direction_data, gradient, max_batches, options) -> tuple[dict, dict, str]:
    """`(G_S, G of the direction's data, "train" | "held-out")` of the block at `position`, at zero init."""
    if gradient is None:
        grad_train = probe(model, batches, positions=[position], **options).gradients[0]
    else:
        grad_train = gradient
    if direction_data is None:
        return grad_train, grad_train, "train"
    on_dir = probe(model, direction_data, positions=[position], max_batches=max_batches, **options)
    return grad_train, on_dir.gradients[0], "held-out"


def _new_block(grown: nn.Module, before: set[int]) -> nn.Module:
    """The smallest module holding exactly the parameters `grow_depth` just added."""
    new = {id(p) for p in grown.parameters() if id(p) not in before}
    best = None
    for name, module in grown.named_modules():
        if {id(p) for p in module.parameters()} == new and (best is None or name.count(".") >= best[0].count(".")):
            best = (name, module)
    if best is None:  # pragma: no cover - grow_depth always adds one module's parameters
        raise RuntimeError("cannot find the block grow_depth inserted")
    return best[1]


def _grow_copy(model: nn.Module, position: int, cfg: GrowthConfig, grad_train: dict, grad_dir: dict):
    """`(grown copy, {name: parameter})`: a deep copy grown at `position`, and the new block's parameters
    the gradients name (checked to be exactly the block's, with its shapes)."""
    grown = copy.deepcopy(model)
    before = {id(p) for p in grown.parameters()}
    grow_depth(grown, [position], config=cfg)
    new = _new_block(grown, before)
    shapes = {name: tuple(p.shape) for name, p in new.named_parameters()}
    mismatch = [n for n in set(grad_dir) | set(grad_train) if n not in shapes
                or tuple(grad_dir.get(n, grad_train.get(n)).shape) != shapes[n]]
    if mismatch or set(grad_dir) != set(grad_train):
        raise ValueError(
            f"gradient does not belong to the block inserted at {position} with these settings "
            f"(unknown or mis-shaped: {sorted(mismatch)[:4]}); pass the probe's gradients for the same position and block"
        )
    return grown, {name: new.get_parameter(name) for name in grad_dir}


class _Step:
    """`theta = eta * v` on the new block's parameters, `v = -G / ||G||` (no direction when `G = 0`)."""

    def __init__(self, params: dict[str, nn.Parameter], grad_train: dict, grad_dir: dict):
        self.params = params
        self.grad_norm = math.sqrt(sum(float(t.double().square().sum()) for t in grad_dir.values()))
        if self.grad_norm > 0:
            self.direction = {name: -t / self.grad_norm for name, t in grad_dir.items()}
            self.slope = sum(float((grad_train[name].double() * self.direction[name].double()).sum()) for name in self.direction)
        else:
            self.direction, self.slope = None, 0.0

    def set(self, eta: float) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                if self.direction is None or eta == 0:
                    p.zero_()
                else:
                    p.copy_((eta * self.direction[name]).to(dtype=p.dtype, device=p.device))


def stepping_stone(
    model: nn.Module,
    position: int,
    train_data,
    *,
    direction_data=None,
    block: str = "auto",
    init: str = "copy",
    seed: int = 0,
    eps: float | None = None,
    adapter_dim: int | None = None,
    adapter_act: str = "gelu",
    etas: Sequence[float] | None = None,
    expand: float = 4.0,
    max_expand: int = 12,
    refine_steps: int = 2,
    max_batches: int | None = None,
    collate_fn: Callable | None = None,
    batch_size: int = 8,
    gradient: dict[str, torch.Tensor] | None = None,
    progress: bool = False,
) -> tuple[nn.Module, SteppingStoneResult]:
    """Grow a copy of `model` at `position` and take one first-order step of the new block: a stepping stone.

    The new block's zero-initialised parameters are set to `theta = eta * v`, `v = -G / ||G||`, `G` the
    gradient of the loss on `direction_data` (default `train_data`) at zero init (`probe`). `eta` minimises
    the training loss: with `etas=None` a geometric search from the step whose first-order gain is 1% of
    the loss (`FIRST_GAIN`; by factors of `expand`, at most `max_expand` times), then `refine_steps`
    parabolic-interpolation steps inside the bracket; else the best of `etas`. A step that does not lower
    the loss is not taken (`eta = 0`).

    Args:
        model: As for `probe` / `grow_depth`; not changed (a deep copy is grown).
        position: Insertion point k, 0 <= k <= L.
        train_data: Training data, any form `probe` reads; the line search and the reported losses use it.
        direction_data: Data for `G`; `None` uses `train_data` (`f~_S`), a held-out split gives `f~_pop`.
        block, init, seed, eps, adapter_dim, adapter_act: As in `GrowthConfig`.
        etas, expand, max_expand, refine_steps: Candidate steps, or the shape of the automatic search.
        max_batches, collate_fn, batch_size: As for `probe` (applied to both data sets).
        gradient: `G_S` of this block, as `probe(..., keep_gradients=True).gradients[i]` gives it (same block
            settings); skips the probe pass over `train_data`.
        progress: Progress bars of the probe passes and the line search.

    Returns:
        `(grown_model, SteppingStoneResult)`; the result's `gradient` is `G` of the direction's data, from
        which `rebuild_stepping_stone` makes the same model again without a pass over any data.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
        >>> model = tiny_model("llama")
        >>> stone, info = stepping_stone(model, 2, [tiny_inputs(model, seed=s) for s in range(4)])
        >>> info.loss_stone < info.loss_old
        True
        ```
    """
    settings = dict(block=block, init=init, seed=seed, eps=eps, adapter_dim=adapter_dim, adapter_act=adapter_act, etas=etas,
                    expand=expand, max_expand=max_expand, refine_steps=refine_steps, max_batches=max_batches,
                    collate_fn=collate_fn, batch_size=batch_size, gradient=gradient, progress=progress)
    return _stones(model, position, train_data, [direction_data], **settings)[0]


def stepping_stones(model: nn.Module, position: int, train_data, held_out, **kwargs) -> dict[str, tuple[nn.Module, SteppingStoneResult]]:
    """Both stepping stones of docs/theory.md §3 at one position: `f~_S` (train direction) and `f~_pop` (held-out direction).

    The same as `stepping_stone(model, position, train_data, **kwargs)` and `stepping_stone(...,
    direction_data=held_out, **kwargs)`, bit for bit, for less: the two line searches run on the same
    training batches from the same original layers below the block, so the prefix there and
    `L_S(f_old)` are computed once for both, and `G_S` (the probe's, or one pass) serves both.

    Args:
        model, position, train_data: As for `stepping_stone`.
        held_out: Data for `f~_pop`'s direction (any form `probe` reads).
        kwargs: Every other argument of `stepping_stone` (not `direction_data`).

    Returns:
        `{"train": (f~_S, result), "held_out": (f~_pop, result)}`.

    Example:
        ```python
        >>> from hf_depthgrow.testing import tiny_model, tiny_inputs
        >>> model = tiny_model("llama")
        >>> stones = stepping_stones(model, 2, [tiny_inputs(model, seed=s) for s in range(4)], [tiny_inputs(model, seed=9)])
        >>> sorted(stones), stones["held_out"][1].direction
        (['held_out', 'train'], 'held-out')
        ```
    """
    if "direction_data" in kwargs:
        raise TypeError("stepping_stones takes held_out, not direction_data")
    unknown = sorted(set(kwargs) - set(_STONE_SETTINGS))
    if unknown:
        raise TypeError(f"stepping_stones got unexpected arguments {unknown}")
    train, pop = _stones(model, position, train_data, [None, held_out], **{**_STONE_SETTINGS, **kwargs})
    return {"train": train, "held_out": pop}


# `stepping_stones`' defaults: `stepping_stone`'s keyword arguments, from one place.
_STONE_SETTINGS = {
    name: param.default for name, param in inspect.signature(stepping_stone).parameters.items()
    if param.kind is param.KEYWORD_ONLY and name != "direction_data"
}


def _stones(model, position, train_data, directions: list, *, block, init, seed, eps, adapter_dim, adapter_act, etas,
            expand, max_expand, refine_steps, max_batches, collate_fn, batch_size, gradient, progress) -> list:
    """One stepping stone per direction data (`None`: the training data's), all on one set of line-search batches."""
    cfg = GrowthConfig(block=block, init=init, eps=eps, seed=seed, adapter_dim=adapter_dim, adapter_act=adapter_act)
    _check_search(etas, expand)
    options = dict(block=block, init=init, seed=seed, eps=eps, adapter_dim=adapter_dim, adapter_act=adapter_act,
                   covariance=False, collate_fn=collate_fn, batch_size=batch_size, progress=progress, keep_gradients=True)
    batches = list(as_batches(train_data, batch_size=batch_size, collate_fn=collate_fn, max_batches=max_batches))
    _check_train_batches(model, batches)
    if gradient is not None:
        _check_gradient(gradient)
    search = dict(expand=expand, max_expand=max_expand, refine_steps=refine_steps)
    block_kind = resolve_block_kind(cfg, resolve_family(model)[0], model.config)
    stones, shared = [], None
    for direction_data in directions:
        grad_train, grad_dir, source = _gradients(model, position, batches, direction_data, gradient, max_batches, options)
        gradient = grad_train  # the next direction reuses G_S
        grown, params = _grow_copy(model, position, cfg, grad_train, grad_dir)
        step = _Step(params, grad_train, grad_dir)
        desc = f"stepping stone k={position} ({source})" if progress else None
        shared, best = choose_eta(grown, batches, step, etas, search, desc, shared)
        loss_old = shared.cache[0.0]
        stones.append((grown, SteppingStoneResult(
            position=position, block=block_kind, direction=source, eta=best, grad_norm=step.grad_norm, slope=step.slope,
            loss_old=loss_old, loss_stone=shared.cache[best], predicted_first_order=loss_old + best * step.slope,
            line_search=shared.trace, num_batches=len(batches), config=asdict(cfg), gradient=grad_dir,
        )))
    return stones


def rebuild_stepping_stone(model: nn.Module, result: SteppingStoneResult, gradient: dict[str, torch.Tensor]) -> nn.Module:
    """The stepping stone `result` describes, from the original `model` and the direction's gradient `G`: no data read.

    It is grown and stepped as `stepping_stone` grew and stepped it (`result.config`, `result.position`,
    `theta = result.eta * -G / ||G||`), so with the same `model` and `G` its weights are the same, bit for bit.

    Example:
        ```python
        >>> stone, info = stepping_stone(model, 3, rows)
        >>> again = rebuild_stepping_stone(model, info, info.gradient)
        ```
    """
    _check_gradient(gradient)
    grown, params = _grow_copy(model, result.position, GrowthConfig(**result.config), gradient, gradient)
    step = _Step(params, gradient, gradient)
    if abs(step.grad_norm - result.grad_norm) > 1e-9 * max(1.0, result.grad_norm):
        raise ValueError(f"gradient has norm {step.grad_norm:.6g}, the stepping stone's direction had {result.grad_norm:.6g}: not its gradient")
    step.set(result.eta)
    return grown
