"""Configuration of a scaling study: one `TaskGrid` per task (grid and budget) inside a `StudyConfig`."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..utils import check_int, is_int

TASKS = ("vit", "lm")
VISION_DATASETS = ("fashion_mnist", "digits")


@dataclass
class TaskGrid:
    """One task's grid and training budget.

    Example:
        ```python
        >>> grid = TaskGrid(task="vit", dataset="digits", depths=[1, 2], widths=[16, 32], data_sizes=[300, 900])
        ```
    """

    task: str = field(default="vit", metadata={"help": "`vit` (image classification) or `lm` (character language model)."})
    dataset: str = field(default="fashion_mnist", metadata={"help": "vit: `fashion_mnist` or `digits`; lm: `shakespeare`."})
    depths: list[int] = field(default_factory=lambda: [1, 2, 4], metadata={"help": "Numbers of layers L before growth."})
    widths: list[int] = field(default_factory=lambda: [16, 32, 64], metadata={"help": "Hidden sizes d (multiples of head_dim)."})
    data_sizes: list[int] = field(
        default_factory=lambda: [1000, 3000, 9000],
        metadata={"help": "Training set sizes n: images (vit) or token blocks of `block_size` (lm)."},
    )
    head_dim: int = field(default=16, metadata={"help": "Attention head size; heads = width / head_dim."})
    mlp_ratio: int = field(default=4, metadata={"help": "MLP hidden size = mlp_ratio * width."})
    patch_size: int = field(default=7, metadata={"help": "ViT patch size (28x28 Fashion-MNIST: 7 gives 16 patches)."})
    block_size: int = field(default=64, metadata={"help": "LM context length in characters."})
    train_steps: int = field(default=300, metadata={"help": "Optimizer steps for each base model."})
    grow_steps: int = field(default=150, metadata={"help": "Optimizer steps for the new block after growth."})
    batch_size: int = field(default=64, metadata={"help": "Examples per step."})
    learning_rate: float = field(default=3e-3, metadata={"help": "Peak learning rate of the base models (AdamW, cosine)."})
    grow_learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate of the new block."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    eval_every: int = field(default=50, metadata={"help": "Held-out evaluation interval (the learning curve in each cell)."})
    heldout_size: int = field(default=500, metadata={"help": "Held-out examples (selection, disjoint from train and test)."})
    test_size: int = field(default=1000, metadata={"help": "Test examples for the reported losses and the paired delta."})
    probe_batches: int = field(default=16, metadata={"help": "Training batches the probe reads."})
    probe_batch_size: int = field(default=32, metadata={"help": "Examples per probe batch."})
    selection_examples: int = field(default=1000, metadata={"help": "Seeded subset of training examples on which the fallback rule compares losses."})

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        allowed = VISION_DATASETS if self.task == "vit" else ("shakespeare",)
        if self.task == "lm" and self.dataset == "fashion_mnist":
            self.dataset = "shakespeare"  # the dataclass default belongs to the vision task
        if self.dataset not in allowed:
            raise ValueError(f"dataset {self.dataset!r} does not fit task {self.task!r}; choose one of {allowed}")
        for name in ("depths", "widths", "data_sizes"):
            values = getattr(self, name)
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"{name} must be a non-empty list, got {values!r}")
            if not all(is_int(v) and v >= 1 for v in values):
                raise ValueError(f"{name} must hold positive integers, got {values!r}")
            if len(set(values)) != len(values):
                raise ValueError(f"{name} has repeated values: {values!r}")
            setattr(self, name, sorted(int(v) for v in values))
        bad = [w for w in self.widths if w % self.head_dim]
        if bad:
            raise ValueError(f"widths {bad} are not multiples of head_dim={self.head_dim}")
        for name in ("head_dim", "mlp_ratio", "patch_size", "block_size", "train_steps", "grow_steps", "batch_size",
                     "eval_every", "heldout_size", "test_size", "probe_batches", "probe_batch_size", "selection_examples"):
            check_int(name, getattr(self, name), 1)
        for name in ("learning_rate", "grow_learning_rate"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")

    def cells(self) -> list[tuple[int, int, int]]:
        """Every `(depth, width, data_size)` of the grid, in a fixed order (data size slowest, depth fastest).

        Example:
            ```python
            >>> TaskGrid(task="vit", dataset="digits", depths=[1, 2], widths=[16], data_sizes=[300]).cells()
            [(1, 16, 300), (2, 16, 300)]
            ```
        """
        return [(L, d, n) for n in self.data_sizes for d in self.widths for L in self.depths]


@dataclass
class StudyConfig:
    """A scaling study: one or more task grids plus shared settings.

    Example:
        ```python
        >>> cfg = StudyConfig.from_dict({"output_dir": "out", "tasks": {"digits": {"task": "vit", "dataset": "digits"}}})
        >>> cfg.tasks["digits"].depths
        [1, 2, 4]
        ```
    """

    output_dir: str = field(default="docs/scaling", metadata={"help": "Folder for cells, results, figures and tables."})
    seed: int = field(default=0, metadata={"help": "Seed of data splits, initialisation and batch order."})
    threads: int = field(default=1, metadata={"help": "torch threads per process (tiny models: 1 per core, many processes)."})
    fit_bootstrap: int = field(default=200, metadata={"help": "Bootstrap refits for the power-law intervals (0: none)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar over the cells."})
    tasks: dict[str, TaskGrid] = field(default_factory=dict, metadata={"help": "Name -> task grid."})
    # Where cells run: compare's engines and flags. A cell is one trial (spec in, stored result out); the
    # engines change where it runs, never what it computes (each cell uses `threads` torch threads on both).
    engine: str = field(
        default="serial",
        metadata={"help": "Where cells run: serial (this process; under torchrun each process its share) or ray (each cell a "
                          'Ray Tune trial, local or --ray-address; pip install "hf_depthgrow[ray]").', "choices": ["serial", "ray"]},
    )
    ray_address: str | None = field(default=None, metadata={"help": "engine ray: the cluster (host:port, ray://host:port or auto); none: a local Ray."})
    max_concurrent_trials: int | None = field(default=None, metadata={"help": "engine ray: cells at once (none: as many as the resources allow)."})
    resources_per_trial: int | None = field(default=None, metadata={"help": "engine ray: CPUs per cell (none: `threads`)."})

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("a study needs at least one task under `tasks`")
        self.tasks = {
            str(name): grid if isinstance(grid, TaskGrid) else TaskGrid(**_known(TaskGrid, grid, f"tasks.{name}"))
            for name, grid in self.tasks.items()
        }
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.fit_bootstrap < 0:
            raise ValueError(f"fit_bootstrap must be >= 0, got {self.fit_bootstrap}")
        self._check_engine()

    def _check_engine(self) -> None:
        """compare's checks (Ray looked for, not imported: missing, it is one line before any work)."""
        from ..comparison.ray_engine import check_engine

        if self.engine not in ("serial", "ray"):
            raise ValueError(f"engine must be one of ['serial', 'ray'], got {self.engine!r}")
        # Serial cells run with `threads` CPUs: another count would be ignored (a config's own to_dict() holds threads).
        if self.resources_per_trial not in (None, self.threads) and self.engine != "ray":
            raise ValueError(f"resources_per_trial is a Ray Tune setting, but engine is {self.engine!r} (one cell at a time, "
                             "here): use engine='ray' or drop it")
        if self.resources_per_trial is None:
            self.resources_per_trial = self.threads  # a cell's CPUs: the torch threads it runs with
        check_engine(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StudyConfig":
        """A config from plain data (as `to_dict` or a YAML file gives it); unknown keys are an error."""
        return cls(**_known(cls, data, "study config"))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "StudyConfig":
        """Read `recipes/configs/scaling/*.yaml`-style files.

        Example:
            ```python
            >>> StudyConfig.from_yaml("recipes/configs/scaling/default.yaml").tasks["lm_shakespeare"].block_size
            64
            ```
        """
        return cls.from_dict(_read_yaml(path))

    def to_dict(self) -> dict:
        """Plain data (what `<output_dir>/config.json` holds); `from_dict(to_dict())` gives the config back."""
        out = asdict(self)
        out["tasks"] = {name: asdict(grid) for name, grid in self.tasks.items()}
        return out


def _read_yaml(path: str | os.PathLike) -> dict:
    from ..utils import kind_of, read_structured

    expected = "a mapping of study settings"
    data = read_structured(path, expected=expected)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected {expected}, got {kind_of(data)}")
    return data


def _known(cls, data: Any, where: str) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(names)}")
    return dict(data)


@dataclass
class StudyCommand:
    """The flags of `recipes/scaling_study.py` (`hf_depthgrow.config.ConfigParser`): the study YAML and what overrides it.

    Flags left out keep the YAML's value (each defaults to `None`: "as the config says").

    Example:
        ```python
        >>> from hf_depthgrow.config import ConfigParser
        >>> (cmd,) = ConfigParser([StudyCommand], config_flag=False).parse(["--config", "study.yaml", "--engine", "ray"])
        >>> cmd.study_config().engine
        'ray'
        ```
    """

    # Not named `config`: ConfigParser reads a field of that name as its own flat YAML of flags.
    study: str = field(metadata={"help": "Study YAML (recipes/configs/scaling/*.yaml).", "flag": "--config"})
    output_dir: str | None = field(default=None, metadata={"help": "Override the config's output_dir."})
    aggregate_only: bool = field(default=False, metadata={"help": "Only rebuild findings, fits, figures, tables from the stored cells."})
    overwrite: bool = field(default=False, metadata={"help": "Delete the output folder's cells first."})
    progress: bool | None = field(default=None, metadata={"help": "Override the config's progress bar setting."})
    threads: int | None = field(default=None, metadata={"help": "Override the config's torch threads per process (and per Ray cell)."})
    engine: str | None = field(default=None, metadata={"help": "Override the config's engine: serial or ray.", "choices": ["serial", "ray"]})
    ray_address: str | None = field(default=None, metadata={"help": "engine ray: the cluster (host:port, ray://host:port or auto); none: a local Ray."})
    max_concurrent_trials: int | None = field(default=None, metadata={"help": "engine ray: cells at once (none: as many as the resources allow)."})
    resources_per_trial: int | None = field(default=None, metadata={"help": "engine ray: CPUs per cell (none: `threads`)."})

    def study_config(self) -> StudyConfig:
        """The YAML's `StudyConfig` with the flags given here in place of its values (checked as a whole)."""
        data = _read_yaml(self.study)
        names = ("output_dir", "progress", "threads", "engine", "ray_address", "max_concurrent_trials", "resources_per_trial")
        data.update({name: getattr(self, name) for name in names if getattr(self, name) is not None})
        return StudyConfig.from_dict(data)
