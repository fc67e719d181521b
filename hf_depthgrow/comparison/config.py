"""`CompareConfig`: the arms, the shared budget and the statistics of `compare_plans` / `hf-depthgrow compare`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..evaluation.bounds import INTERVALS
from ..evaluation.decisions import METHODS
from ..training.tracking import DEFAULT_PROJECT, NONE, REPORT_TO, check_report_to
from ..training.schedules import SCHEDULERS, check_wsd
from ..utils import check_int
from .arms import check_control_spec, check_growth_spec
from .grids import DEFAULT_GRIDS, rates_below


@dataclass
class CompareConfig:
    """Settings of a comparison. Every arm gets the same budget: optimizer steps, batch size (so tokens),
    data order (seed), schedule and learning-rate grid; each arm's rate is chosen on the held-out split.

    Example:
        ```python
        >>> CompareConfig(growth=["probe:1", "interleave:2"], controls=["layers", "lora"], max_steps=40).max_steps
        40
        ```
    """

    growth: list[str] = field(
        default_factory=lambda: ["probe:1", "probe:2", "interleave:2", "top:1", "bottom:1", "random:1"],
        metadata={"help": "Growth arms: probe:N, interleave:N, top:N, bottom:N, random:N, at:k1,k2, or a plan file."},
    )
    controls: list[str] = field(
        default_factory=lambda: ["layers", "lora"],
        metadata={"help": "Control arms that add no depth: layers (matched parameters), lora (matched), full."},
    )
    reference: str | None = field(default=None, metadata={"help": "The growth arm the controls match (default: the first)."})
    matched_controls: bool = field(
        default=True,
        metadata={"help": "Give every growth arm no control matches its own control of the same trainable-parameter count "
                          "(layers[ARM], else lora[ARM]); the verdict compares each growth arm with its match."},
    )
    learning_rates: list[float] | None = field(
        default=None, metadata={"help": "One learning-rate grid for every arm (default: each kind's own grid, below)."}
    )
    growth_learning_rates: list[float] = field(
        default_factory=lambda: list(DEFAULT_GRIDS["growth"]), metadata={"help": "Learning-rate grid of the growth arms."}
    )
    lora_learning_rates: list[float] = field(default_factory=lambda: list(DEFAULT_GRIDS["lora"]), metadata={"help": "Grid of the lora controls."})
    layers_learning_rates: list[float] = field(default_factory=lambda: list(DEFAULT_GRIDS["layers"]), metadata={"help": "Grid of the layers control."})
    full_learning_rates: list[float] = field(default_factory=lambda: list(DEFAULT_GRIDS["full"]), metadata={"help": "Grid of the full control."})
    lr_extensions: int = field(
        default=2, metadata={"help": "Rates (x3 steps) an arm's grid may gain when its chosen rate is at an edge of the rates tried; 0: never."}
    )
    max_learning_rate: float = field(default=0.1, metadata={"help": "The largest rate a grid extension may try (the cap)."})
    forgetting_rates: int = field(
        default=2,
        metadata={"help": "With a retention set: rates (x3 steps) added below every arm's grid, so each kind's forgetting "
                          "curve is traced below its gain-optimal rate; 0: none."},
    )
    successive_halving: bool = field(
        default=False,
        metadata={"help": "Stop the worse half of an arm's learning rates (on held-out loss) at 1/4 and 1/2 of the steps (one budget only). "
                          "Off by default: see docs/decisions.md for how often it kept the full grid's choice."},
    )
    max_steps: int = field(default=20, metadata={"help": "Optimizer steps of every arm (one budget; see budgets)."})
    budgets: list[int] | None = field(
        default=None, metadata={"help": "Budgets (optimizer steps, increasing): every arm is scored at each, as if trained alone (WSD schedule)."}
    )
    batch_size: int = field(default=8, metadata={"help": "Examples per optimizer step (and per evaluation batch)."})
    allow_repeated_data: bool = field(
        default=False,
        metadata={"help": "Let the largest budget need more training blocks than there are (steps x batch size): blocks then "
                          "repeat (epochs are reported per budget). Without it such a comparison is refused before anything trains."},
    )
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute each layer above the frozen prefix in backward instead of keeping its activations (same gradients, less memory)."})
    lr_scheduler: str = field(
        default="auto", metadata={"help": "auto (cosine for one budget, wsd for several), cosine, linear, constant or wsd.", "choices": ["auto", *SCHEDULERS]}
    )
    warmup_ratio: float = field(default=0.1, metadata={"help": "Warm-up share of the smallest budget's steps."})
    warmup_steps: int = field(default=0, metadata={"help": "Warm-up steps (instead of warmup_ratio; the same for every budget)."})
    decay_ratio: float = field(default=0.2, metadata={"help": "wsd: each budget decays over its last share of steps."})
    max_forgetting: float | None = field(
        default=None, metadata={"help": "Forgetting budget EPS (nats): the verdict names the best-gain arm whose forgetting's upper bound stays within it."}
    )
    retention_selection_fraction: float = field(
        default=0.5, metadata={"help": "Share of the retention set that chooses (frontier, arm within EPS); the rest is reported."}
    )
    cluster_key: str | None = field(
        default="auto",
        metadata={"help": "Column naming each example's document, the unit of independence: the retention set's selection and test "
                          "parts are disjoint in it and the bootstrap resamples it (all blocks of a drawn document together); "
                          "auto: 'document' where the data has it (load_data writes it for LM blocks); none: examples are independent."},
    )
    selection_max_examples: int | None = field(
        default=64, metadata={"help": "Training examples the fallback rule compares on (None: all)."}
    )
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": "Name suffixes the LoRA control adapts."})
    delta: float = field(default=0.05, metadata={"help": "Family-wise error of the intervals across arms."})
    method: str = field(default="holm", metadata={"help": "holm or bonferroni.", "choices": list(METHODS)})
    interval: str = field(default="bootstrap", metadata={"help": "bootstrap, bernstein or hoeffding.", "choices": list(INTERVALS)})
    loss_bound: float | None = field(default=None, metadata={"help": "B for bernstein/hoeffding intervals."})
    n_bootstrap: int = field(default=2000, metadata={"help": "Paired bootstrap resamples."})
    seed: int = field(default=0, metadata={"help": "Seeds the data order, random placements and the bootstrap."})
    progress: bool = field(default=True, metadata={"help": "Show progress bars."})
    report_to: list[str] = field(
        default_factory=lambda: [NONE],
        metadata={"help": "Experiment trackers (Accelerate's): tensorboard, wandb (several allowed) or none. One run per arm "
                          "and learning rate, plus the probe and the corrected deltas.", "choices": [NONE, *REPORT_TO]},
    )
    logging_dir: str | None = field(default=None, metadata={"help": "Where trackers write; hf-depthgrow compare's default: <output_dir>/logs."})
    project_name: str = field(default=DEFAULT_PROJECT, metadata={"help": "Project name in the trackers (the W&B project)."})
    engine: str = field(
        default="serial",
        metadata={"help": "Where trials run: serial (here, one after another), ray (Ray Tune, local or --ray-address; "
                          'pip install "hf_depthgrow[ray]"), or stored (train nothing: every trial from --trials-dir; compare --gather).',
                  "choices": ["serial", "ray", "stored"]},
    )
    ray_address: str | None = field(default=None, metadata={"help": "engine ray: the cluster (host:port, ray://host:port or auto); none: a local Ray."})
    max_concurrent_trials: int | None = field(default=None, metadata={"help": "engine ray: trials at once (none: as many as the resources allow)."})
    resources_per_trial: int = field(default=1, metadata={"help": "engine ray: CPUs per trial (also its torch threads)."})
    workers_per_trial: int = field(
        default=1,
        metadata={"help": "engine ray: processes per trial (above 1: a Ray Train TorchTrainer of N DDP workers, each with "
                          "--resources-per-trial and batch_size / N rows of every step)."},
    )
    accelerate_config: str | None = field(
        default=None,
        metadata={"help": "workers_per_trial > 1: an accelerate config file (recipes/accelerate_configs/fsdp.yaml, deepspeed/"
                          "zero2.yaml) whose set-up every trial's workers take, as `accelerate launch` would give it: "
                          "FSDP2 or DeepSpeed ZeRO instead of DDP (native growth blocks, layers and full; not LoRA)."},
    )

    def __post_init__(self):
        def fail(msg):
            raise ValueError(msg)

        # One spec given as a string is one arm (iterating it would read "top:1" as the arms "t", "o", ...).
        if isinstance(self.growth, str):
            self.growth = [self.growth]
        if isinstance(self.controls, str):
            self.controls = [self.controls]
        if not isinstance(self.growth, (list, tuple)) or not self.growth or not all(isinstance(g, (str, list, dict)) for g in self.growth):
            fail(f"growth must be a non-empty list of placement specs, got {self.growth!r}")
        for spec in self.growth:
            check_growth_spec(spec)
        if not isinstance(self.controls, (list, tuple)):
            fail(f"controls must be a list of control names, got {self.controls!r}")
        for spec in self.controls:
            check_control_spec(spec)
        for name in ("learning_rates", *(f"{k}_learning_rates" for k in DEFAULT_GRIDS)):
            if name != "learning_rates" or self.learning_rates is not None:
                self._check_grid(name)
        for name in ("max_steps", "batch_size", "n_bootstrap"):
            check_int(name, getattr(self, name), 1)
        check_int("selection_max_examples", self.selection_max_examples, 1, allow_none=True)
        for name in ("successive_halving", "progress", "allow_repeated_data", "matched_controls"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{name} must be True or False, got {getattr(self, name)!r}")
        self._check_budgets()
        self._check_extension()
        if not isinstance(self.delta, (int, float)) or not 0 < self.delta < 1:
            fail(f"delta must be in (0, 1), got {self.delta!r}")
        if self.max_forgetting is not None and not (_number(self.max_forgetting) and self.max_forgetting >= 0):
            fail(f"max_forgetting must be a number of nats >= 0, got {self.max_forgetting!r}")
        if not _number(self.retention_selection_fraction) or not 0 < self.retention_selection_fraction < 1:
            fail(f"retention_selection_fraction must be in (0, 1), got {self.retention_selection_fraction!r}")
        if self.cluster_key is not None and (not isinstance(self.cluster_key, str) or not self.cluster_key.strip()):
            fail(f"cluster_key must be a column name, auto or none, got {self.cluster_key!r}")
        for name, allowed in (("method", METHODS), ("interval", INTERVALS)):
            if getattr(self, name) not in allowed:
                fail(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.interval != "bootstrap" and self.loss_bound is None:
            fail(f"interval={self.interval!r} needs loss_bound (an a-priori bound B of a per-example loss)")
        check_int("seed", self.seed, 0)
        self.report_to = check_report_to(self.report_to)
        if not isinstance(self.project_name, str) or not self.project_name.strip():
            fail(f"project_name must be a non-empty string, got {self.project_name!r}")
        from .ray_engine import check_engine  # engine, Ray settings; Ray itself is not imported

        check_engine(self)
        # Ray Tune's own settings mean nothing to the other engines; run silently without them, a user who asked
        # for four CPUs per trial would wait for a serial sweep believing it parallel, so they are refused.
        if self.engine != "ray" and self.resources_per_trial != 1:
            fail(f"resources_per_trial is a Ray Tune setting, but engine is {self.engine!r} (one trial at a time, here): "
                 "use engine='ray' or drop it")
        from .ray_workers import check_workers  # workers_per_trial: above 1 on Ray only, dividing the batch

        check_workers(self)

    def _check_grid(self, name: str) -> None:
        rates = getattr(self, name)
        if not isinstance(rates, (list, tuple)) or not rates or not all(_number(r) and r > 0 for r in rates):
            raise ValueError(f"{name} must be a non-empty list of finite numbers > 0, got {rates!r}")
        if len(set(rates)) != len(rates):
            raise ValueError(f"{name} has repeated values: {list(rates)}")
        setattr(self, name, sorted(float(r) for r in rates))

    def _check_budgets(self) -> None:
        b = self.budgets
        if b is not None:
            if not isinstance(b, (list, tuple)) or not b or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in b):
                raise ValueError(f"budgets must be a non-empty list of step counts >= 1, got {b!r}")
            if any(y <= x for x, y in zip(b, b[1:])):
                raise ValueError(f"budgets must be strictly increasing, got {list(b)}")
            self.budgets = list(b)
        b = self.sweep
        if self.lr_scheduler not in ("auto", *SCHEDULERS):
            raise ValueError(f"lr_scheduler must be auto or one of {SCHEDULERS}, got {self.lr_scheduler!r}")
        if len(b) > 1 and self.lr_scheduler not in ("auto", "wsd"):
            raise ValueError(f"several budgets need lr_scheduler='wsd' (each budget decays as if trained alone), got {self.lr_scheduler!r}")
        if len(b) > 1 and self.successive_halving:
            raise ValueError("successive_halving stops rates at shares of one budget: use it with a single budget")
        if not _number(self.warmup_ratio) or not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        check_int("warmup_steps", self.warmup_steps, 0)
        if not _number(self.decay_ratio) or not 0 < self.decay_ratio <= 1:
            raise ValueError(f"decay_ratio must be in (0, 1], got {self.decay_ratio!r}")
        if self.scheduler == "wsd":
            for budget in b:  # the smallest budget binds; the message names the budget
                try:
                    check_wsd(budget, self.warmup, self.decay_ratio)
                except ValueError as e:
                    raise ValueError(f"budget {budget} is too small for its warm-up: {e}") from None
        elif self.warmup > b[0]:
            raise ValueError(f"the warm-up ({self.warmup} steps) is longer than the budget ({b[0]} steps)")

    def _check_extension(self) -> None:
        for name in ("lr_extensions", "forgetting_rates"):
            check_int(name, getattr(self, name), 0)
        if not _number(self.max_learning_rate) or self.max_learning_rate <= 0:
            raise ValueError(f"max_learning_rate must be a finite number > 0, got {self.max_learning_rate!r}")
        # Only the grids of the kinds in the run (growth and its controls'): the full control's grid is no reason to
        # refuse a growth-only sweep.
        kinds = {"growth", *(str(c).partition(":")[0] for c in self.controls if c != "original")}
        top, kind = max((max(self.grid(k)), k) for k in kinds)
        if self.max_learning_rate < top:
            grid = "the grid" if self.learning_rates is not None else f"the {kind} arms' grid"
            raise ValueError(f"max_learning_rate ({self.max_learning_rate:g}) is below the largest rate of {grid} ({top:g}): "
                             "the cap must not cut the grid")

    @property
    def sweep(self) -> list[int]:
        """The budgets every arm is scored at: `budgets`, or `[max_steps]`."""
        return list(self.budgets) if self.budgets is not None else [self.max_steps]

    @property
    def scheduler(self) -> str:
        """The schedule every trial runs: `auto` is cosine for one budget and warmup-stable-decay for several."""
        if self.lr_scheduler == "auto":
            return "wsd" if len(self.sweep) > 1 else "cosine"
        return self.lr_scheduler

    @property
    def warmup(self) -> int:
        """Warm-up steps, the same for every budget (so every budget shares the stable phase)."""
        return self.warmup_steps or math.ceil(self.warmup_ratio * self.sweep[0])

    def grid(self, kind: str, *, retention: bool = False) -> list[float]:
        """The learning-rate grid of an arm kind (`learning_rates` when set: one grid for every arm).

        With `retention` (forgetting is measured), `forgetting_rates` x3 steps below the grid come first (`rates_below`).
        """
        rates = list(self.learning_rates) if self.learning_rates is not None else list(getattr(self, f"{kind}_learning_rates"))
        return (rates_below(rates, self.forgetting_rates) if retention else []) + rates

    def to_dict(self) -> dict:
        return asdict(self)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
