"""`CompareConfig`: the arms, the shared budget and the statistics of `compare_plans` / `hf-depthgrow compare`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ..evaluation.bounds import INTERVALS
from ..evaluation.decisions import METHODS
from ..training.tracking import DEFAULT_PROJECT, NONE, REPORT_TO, check_report_to
from .arms import CONTROL_KINDS, check_growth_spec

SCHEDULERS = ("cosine", "linear", "constant")


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
    learning_rates: list[float] = field(
        default_factory=lambda: [3e-4, 1e-3], metadata={"help": "The learning-rate grid every arm is trained with."}
    )
    successive_halving: bool = field(
        default=True, metadata={"help": "Stop the worse half of an arm's learning rates (on held-out loss) at 1/4 and 1/2 of the steps."}
    )
    max_steps: int = field(default=20, metadata={"help": "Optimizer steps of every arm."})
    batch_size: int = field(default=8, metadata={"help": "Examples per optimizer step (and per evaluation batch)."})
    lr_scheduler: str = field(default="cosine", metadata={"help": "cosine, linear or constant.", "choices": list(SCHEDULERS)})
    warmup_ratio: float = field(default=0.1, metadata={"help": "Warm-up share of the steps."})
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
    )  # fmt: skip
    logging_dir: str | None = field(default=None, metadata={"help": "Where trackers write; hf-depthgrow compare's default: <output_dir>/logs."})
    project_name: str = field(default=DEFAULT_PROJECT, metadata={"help": "Project name in the trackers (the W&B project)."})

    def __post_init__(self):
        def fail(msg):
            raise ValueError(msg)

        def positive_int(name):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(f"{name} must be an int >= 1, got {value!r}")

        if not self.growth or not all(isinstance(g, (str, list, dict)) for g in self.growth):
            fail(f"growth must be a non-empty list of placement specs, got {self.growth!r}")
        for spec in self.growth:
            check_growth_spec(spec)
        bad = [c for c in self.controls if c not in CONTROL_KINDS]
        if bad:
            fail(f"unknown control arm(s) {bad}: choose from {list(CONTROL_KINDS)}")
        rates = self.learning_rates
        if not rates or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0 for r in rates):
            fail(f"learning_rates must be a non-empty list of finite numbers > 0, got {rates!r}")
        if len(set(rates)) != len(rates):
            fail(f"learning_rates has repeated values: {rates}")
        for name in ("max_steps", "batch_size", "n_bootstrap"):
            positive_int(name)
        if self.selection_max_examples is not None:
            positive_int("selection_max_examples")
        if not isinstance(self.successive_halving, bool):
            fail(f"successive_halving must be True or False, got {self.successive_halving!r}")
        if self.lr_scheduler not in SCHEDULERS:
            fail(f"lr_scheduler must be one of {SCHEDULERS}, got {self.lr_scheduler!r}")
        if not isinstance(self.warmup_ratio, (int, float)) or not 0 <= self.warmup_ratio < 1:
            fail(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if not isinstance(self.delta, (int, float)) or not 0 < self.delta < 1:
            fail(f"delta must be in (0, 1), got {self.delta!r}")
        if self.method not in METHODS:
            fail(f"method must be one of {METHODS}, got {self.method!r}")
        if self.interval not in INTERVALS:
            fail(f"interval must be one of {INTERVALS}, got {self.interval!r}")
        if self.interval != "bootstrap" and self.loss_bound is None:
            fail(f"interval={self.interval!r} needs loss_bound (an a-priori bound B of a per-example loss)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            fail(f"seed must be an int >= 0, got {self.seed!r}")
        self.report_to = check_report_to(self.report_to)
        if not isinstance(self.project_name, str) or not self.project_name.strip():
            fail(f"project_name must be a non-empty string, got {self.project_name!r}")

    def to_dict(self) -> dict:
        return asdict(self)
