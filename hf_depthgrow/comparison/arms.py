"""The arms of a comparison: growth plans and the equal-budget controls that add no depth.

An arm is what a user could do with the same optimizer steps, tokens and schedule:

- **growth** (`kind="growth"`): insert blocks where a placement spec says (`"probe:N"`, `"interleave:N"`,
  `"top:N"`, `"bottom:N"`, `"random:N"`, `"at:10,20"`, a plan or a mergekit file) and train only them;
- **layers**: train the *existing* layers the reference growth arm's blocks copy, in full. A native block
  is a copy of its source layer, so the trainable-parameter count matches exactly;
- **lora**: LoRA on every linear layer of the stack, the rank chosen so that its parameter count is the
  closest to the reference arm's (matched up to one rank step; both counts are reported);
- **full**: every parameter (same steps; not parameter-matched, the upper end of what training buys);
- **original**: no training, the reference of every delta.

`layers` and `lora` match the reference growth arm. Every other growth arm whose trainable-parameter count
no control matches gets its own matched control (`matched=True`, the default): `layers[ARM]`, the layers its
blocks copy, where that count is exact (native blocks), else `lora[ARM]`, the closest LoRA rank. The verdict
compares each growth arm with its match (`matched_control`) as well as with the best control overall.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
from torch import nn

from ..growth.engine import grow_depth, new_block_parameters
from ..growth.towers import resolve_family
from ..growth.placement import PlacementEntry, check_placement, resolve_positions


@dataclass(frozen=True)
class ArmKind:
    """One kind of arm, the one place it is spelled: what it trains (`TrainConfig.trainable`; `None`: nothing),
    its default learning-rate grid (`CompareConfig.<name>_learning_rates`, see `comparison.grids`), and whether
    it is a control (an arm that adds no depth)."""

    name: str
    trainable: str | None
    grid: tuple[float, ...]
    control: bool


ARM_KINDS = {kind.name: kind for kind in (
    ArmKind("growth", "new", (1e-3, 3e-3, 1e-2), control=False),
    ArmKind("layers", "layers", (1e-4, 3e-4, 1e-3), control=True),
    ArmKind("lora", "lora", (1e-3, 3e-3, 1e-2), control=True),
    ArmKind("full", "full", (3e-5, 1e-4, 3e-4), control=True),
    ArmKind("original", None, (), control=True),
)}
CONTROL_KINDS = tuple(k.name for k in ARM_KINDS.values() if k.control)  # what `controls=` may name
TRAINED_CONTROLS = tuple(k for k in CONTROL_KINDS if ARM_KINDS[k].trainable is not None)
_OWN_PRESETS = ("bottom", "random", "at")


@dataclass
class Arm:
    """One arm, resolved against the model: what grows, what trains, how many parameters.

    Attributes:
        name: Unique label (the spec as given, e.g. `"probe:1"`, `"layers"`).
        kind: `"growth"` or one of `CONTROL_KINDS`.
        spec: The spec as given (string, list or plan).
        placement: Growth arms: the resolved entries (`at`, `copy_from`, `init`).
        layers: `"layers"` controls: the stack indices trained.
        lora_r: `"lora"` controls: the rank.
        trainable_parameters: What trains (0 for the original).
        matched_to: The growth arm whose parameter count a control matches.
    """

    name: str
    kind: str
    spec: object = None
    placement: list[PlacementEntry] = field(default_factory=list)
    layers: list[int] | None = None
    lora_r: int | None = None
    trainable_parameters: int = 0
    matched_to: str | None = None

    @property
    def positions(self) -> list[int]:
        return [e.at for e in self.placement]

    @classmethod
    def from_dict(cls, data: dict) -> "Arm":
        """The arm `to_dict` wrote (its spec as given aside, which `to_dict` leaves out)."""
        positions = data.get("positions") or []
        inits = data.get("init") or [None] * len(positions)
        placement = [PlacementEntry(at=k, copy_from=j, init=i) for k, j, i in zip(positions, data.get("copy_from") or [], inits)]
        return cls(data["name"], data["kind"], placement=placement, layers=data.get("layers"), lora_r=data.get("lora_r"),
                   trainable_parameters=data.get("trainable_parameters") or 0, matched_to=data.get("matched_to"))

    def to_dict(self) -> dict:
        """The arm as JSON: every field that changes what it trains (it is part of each trial's store key)."""
        out = {
            "name": self.name,
            "kind": self.kind,
            "positions": self.positions or None,
            "copy_from": [e.source for e in self.placement] or None,
            "layers": self.layers,
            "lora_r": self.lora_r,
            "trainable_parameters": self.trainable_parameters,
            "matched_to": self.matched_to,
        }
        if any(e.init is not None for e in self.placement):  # only then: the keys of arms without one stay as they were
            out["init"] = [e.init for e in self.placement]
        return out


def arm_name(spec) -> str:
    """The label of a spec: strings as given, lists as `at:...`, plans by their positions."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, (list, tuple)) and all(isinstance(k, int) for k in spec):
        return "at:" + ",".join(str(k) for k in spec)
    return "plan"


GROWTH_SPECS = "probe:N, interleave:N, top:N, bottom:N, random:N, at:k1,k2, or a plan/mergekit file"


def check_control_spec(spec) -> None:
    """A control is `layers`, `lora` (rank matched to the reference arm), `lora:R` (rank R), `full` or `original`.

    Several LoRA ranks trace the controls' learning-vs-forgetting curve (`comparison.frontier`).

    Example:
        ```python
        >>> check_control_spec("lora:64")
        >>> check_control_spec("lora:0")
        Traceback (most recent call last):
        ValueError: control 'lora:0': lora:R needs an integer rank R >= 1
        ```
    """
    if not isinstance(spec, str):
        raise ValueError(f"a control is a name, got {spec!r}")
    head, sep, tail = spec.partition(":")
    if head == "lora" and sep:
        if not tail.isdigit() or int(tail) < 1:
            raise ValueError(f"control {spec!r}: lora:R needs an integer rank R >= 1")
    elif spec not in CONTROL_KINDS:
        raise ValueError(f"unknown control arm {spec!r}: choose from {list(CONTROL_KINDS)} or lora:R (a LoRA of rank R)")


def check_growth_spec(spec) -> None:
    """Check a growth spec's form before any model loads (ranges need the depth and are checked later).

    Example:
        ```python
        >>> check_growth_spec("random:2")
        >>> check_growth_spec("middle:1")
        Traceback (most recent call last):
        ValueError: unknown growth arm 'middle:1': use probe:N, interleave:N, top:N, bottom:N, random:N, at:k1,k2, or a plan/mergekit file
        ```
    """
    if not isinstance(spec, str):
        return  # lists and plans are checked against the depth in `resolve_growth`
    head, sep, tail = spec.strip().partition(":")
    if head == "at":
        if not tail or not all(x.strip().isdigit() for x in tail.split(",")):
            raise ValueError(f"arm {spec!r}: at: takes comma-separated layer positions, e.g. at:10,20")
    elif head in ("bottom", "random"):
        if not tail.isdigit() or int(tail) < 1:
            raise ValueError(f"arm {spec!r}: {head}:N needs an integer N >= 1")
    else:
        try:
            check_placement(spec)
        except ValueError:
            raise ValueError(f"unknown growth arm {spec!r}: use {GROWTH_SPECS}") from None


def _own_preset(spec: str, num_layers: int, seed: int) -> list[PlacementEntry] | None:
    """`bottom:N`, `random:N` (seeded, distinct positions) and `at:k1,k2`; `None` for the placement module's specs."""
    head, _, tail = spec.partition(":")
    if head not in _OWN_PRESETS:
        return None
    if head == "at":
        try:
            positions = [int(x) for x in tail.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"arm {spec!r}: at: takes comma-separated layer positions, e.g. at:10,20") from None
        return resolve_positions(positions, num_layers)
    if not tail.isdigit() or not 1 <= int(tail) <= num_layers:
        raise ValueError(f"arm {spec!r}: {head}:N needs 1 <= N <= {num_layers}")
    n = int(tail)
    if head == "bottom":
        return resolve_positions(list(range(n)), num_layers)
    rng = np.random.default_rng(seed)
    return resolve_positions(sorted(int(k) for k in rng.choice(num_layers + 1, size=n, replace=False)), num_layers)


def resolve_growth(spec, num_layers: int, *, probe_result=None, seed: int = 0) -> list[PlacementEntry]:
    """The placement entries of a growth spec: the placement module's presets and plans, plus `bottom`, `random`, `at`.

    Example:
        ```python
        >>> [e.at for e in resolve_growth("bottom:2", 4)]
        [0, 1]
        ```
    """
    if isinstance(spec, str):
        own = _own_preset(spec.strip(), num_layers, seed)
        if own is not None:
            return own
    return resolve_positions(spec, num_layers, probe_result=probe_result)


def as_plan(placement: Sequence[PlacementEntry]) -> list[dict]:
    """Placement entries as the plan `grow_depth` takes (a field left at `None` left out)."""
    return [{k: v for k, v in asdict(e).items() if v is not None} for e in placement]


def grow_arm(model: nn.Module, arm: "Arm", grow_kwargs: dict | None = None) -> nn.Module:
    """A grown deep copy of `model` for a growth arm (the model itself is not changed)."""
    import copy

    return grow_depth(copy.deepcopy(model), as_plan(arm.placement), **(grow_kwargs or {}))


def growth_parameters(model: nn.Module, arm: "Arm", grow_kwargs: dict | None = None) -> int:
    """Parameters the arm's new blocks add, counted on a grown copy (native and adapter blocks alike)."""
    grown = grow_arm(model, arm, {**(grow_kwargs or {}), "verify": False})
    return sum(p.numel() for _, p in new_block_parameters(grown))


def matched_layers(placement: Sequence[PlacementEntry], num_layers: int) -> list[int]:
    """Existing layers a `"layers"` control trains for a growth arm: each block's source layer.

    Two blocks copying the same layer would train it once; the next free layer below (else above) stands
    in, so the count still matches for a model whose layers share one shape.

    Example:
        ```python
        >>> matched_layers(resolve_positions([2, 4], 4), 4)
        [1, 3]
        ```
    """
    chosen: list[int] = []
    for e in placement:
        k = e.source
        candidates = [k] + [j for d in range(1, num_layers) for j in (k - d, k + d) if 0 <= j < num_layers]
        chosen.append(next(j for j in candidates if j not in chosen))
    return sorted(chosen)


def lora_rank_for(model: nn.Module, target: int, suffixes: Sequence[str] | None = None) -> tuple[int, int]:
    """`(rank, parameters)` of LoRA on every linear layer of the stack closest to `target` parameters.

    A rank-r LoRA on a `d_in x d_out` linear layer adds `r * (d_in + d_out)` parameters.

    Example:
        ```python
        >>> lora_rank_for(tiny_model("llama"), 4096)
        (2, 4096)
        ```
    """
    from ..training.trainable import lora_target_names

    modules = dict(model.named_modules())
    weights = [modules[name].weight for name in lora_target_names(model, suffixes)]
    per_rank = sum(int(w.shape[0] + w.shape[1]) for w in weights)
    if per_rank == 0:
        raise ValueError("no linear layer in the stack for a LoRA control")
    rank = max(1, int(round(target / per_rank)))
    return rank, rank * per_rank


def build_arms(
    model: nn.Module,
    growth: Sequence,
    controls: Sequence[str] = ("layers", "lora"),
    *,
    reference: str | None = None,
    probe_result=None,
    seed: int = 0,
    lora_target_modules: Sequence[str] | None = None,
    grow_kwargs: dict | None = None,
    matched: bool = True,
) -> list[Arm]:
    """Resolve every arm against `model` (not changed) before anything trains; the original comes first.

    Args:
        model: The base model (not grown).
        growth: Growth specs (see the module docstring); at least one.
        controls: Any of `"layers"`, `"lora"`, `"lora:R"`, `"full"`; `"original"` is always included.
        reference: The growth arm the controls match (default: the first).
        probe_result: For `"probe:N"` specs.
        seed: Seeds `"random:N"` placements.
        lora_target_modules: Name suffixes the LoRA control adapts (default: every linear layer).
        grow_kwargs: `grow_depth` keyword arguments of every growth arm (`block`, `init`, ...).
        matched: Add a matched control for every growth arm no control matches (see the module docstring).

    Raises:
        ValueError: for an unknown control, duplicate names, a bad spec or an unknown reference.

    Example:
        ```python
        >>> arms = build_arms(tiny_model("llama"), ["top:1", "at:2"], ["layers"])
        >>> [(a.name, a.trainable_parameters) for a in arms]
        [('original', 0), ('top:1', 9280), ('at:2', 9280), ('layers', 9280)]
        ```
    """
    if not growth:
        raise ValueError("a comparison needs at least one growth arm")
    for c in controls:
        check_control_spec(c)
    num_layers = len(resolve_family(model)[1])
    arms = [Arm("original", "original")]
    for spec in growth:
        placement = resolve_growth(spec, num_layers, probe_result=probe_result, seed=seed)
        arm = Arm(arm_name(spec), "growth", spec, placement)
        arm.trainable_parameters = growth_parameters(model, arm, grow_kwargs)
        arms.append(arm)
    names = [a.name for a in arms]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"arm names must be unique, got {duplicated} more than once")
    by_name = {a.name: a for a in arms}
    ref = by_name.get(reference or arms[1].name)
    if ref is None or ref.kind != "growth":
        raise ValueError(f"reference {reference!r} is not a growth arm (have {[a.name for a in arms if a.kind == 'growth']})")
    for kind in dict.fromkeys(c for c in controls if c != "original"):
        arms.append(_control(model, kind, ref, num_layers, lora_target_modules))
    if matched:
        arms += _matched_controls(model, arms, num_layers, lora_target_modules)
    return arms


def matched_control(arms: Sequence, growth: str) -> str | None:
    """The control matched to growth arm `growth`: one built for it, else a `layers`/`lora` control of its exact count.

    `arms` are `Arm`s or their `to_dict()`s (what a `CompareResult` keeps); `layers` is preferred (an exact
    match of native blocks), then `lora`. `None` when no control matches (matched controls turned off).

    Example:
        ```python
        >>> arms = build_arms(tiny_model("llama"), ["top:1", "interleave:2"], ["lora"])
        >>> matched_control(arms, "top:1"), matched_control(arms, "interleave:2")
        ('lora', 'layers[interleave:2]')
        ```
    """
    rows = [a if isinstance(a, dict) else a.to_dict() for a in arms]
    target = next((r for r in rows if r.get("name") == growth), None)
    if target is None:
        return None
    controls = sorted((r for r in rows if r.get("kind") in ("layers", "lora")), key=lambda r: r["kind"] != "layers")
    for rule in (lambda r: r.get("matched_to") == growth,
                 lambda r: r.get("trainable_parameters") == target.get("trainable_parameters")):
        found = next((r["name"] for r in controls if rule(r)), None)
        if found is not None:
            return found
    return None


def _matched_controls(model: nn.Module, arms: list[Arm], num_layers: int, suffixes) -> list[Arm]:
    """A control for each growth arm none matches: `layers[ARM]` where its count is exact, else `lora[ARM]`."""
    added: list[Arm] = []
    for g in [a for a in arms if a.kind == "growth"]:
        if matched_control(arms + added, g.name) is not None:
            continue
        layers = _matched(model, "layers", f"layers[{g.name}]", g, num_layers, suffixes)
        added.append(layers if layers.trainable_parameters == g.trainable_parameters else
                     _matched(model, "lora", f"lora[{g.name}]", g, num_layers, suffixes))
    return added


def _matched(model: nn.Module, kind: str, name: str, growth: Arm, num_layers: int, suffixes) -> Arm:
    """A `layers` control (the layers `growth`'s blocks copy) or a `lora` one (the rank closest to its count) matched to `growth`."""
    if kind == "layers":
        layers = matched_layers(growth.placement, num_layers)
        stack = resolve_family(model)[1]
        count = sum(p.numel() for i in layers for p in stack[i].parameters())
        return Arm(name, "layers", layers=layers, trainable_parameters=count, matched_to=growth.name)
    rank, count = lora_rank_for(model, growth.trainable_parameters, suffixes)
    return Arm(name, "lora", lora_r=rank, trainable_parameters=count, matched_to=growth.name)


def _control(model: nn.Module, kind: str, ref: Arm, num_layers: int, suffixes) -> Arm:
    if kind in ("layers", "lora"):
        return _matched(model, kind, kind, ref, num_layers, suffixes)
    if kind.startswith("lora:"):
        rank = int(kind.partition(":")[2])
        return Arm(kind, "lora", lora_r=rank, trainable_parameters=rank * lora_rank_for(model, 1, suffixes)[1])
    return Arm("full", "full", trainable_parameters=sum(p.numel() for p in model.parameters()))


def check_growth_count(arm: Arm, grown: nn.Module) -> None:
    """The grown model's new parameters are what the arm promised (the controls were matched to it)."""
    actual = sum(p.numel() for _, p in new_block_parameters(grown))
    if actual != arm.trainable_parameters:
        raise RuntimeError(f"arm {arm.name}: the grown blocks have {actual} parameters, {arm.trainable_parameters} were matched")
