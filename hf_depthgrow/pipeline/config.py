"""`RunConfig`: every setting of `hf-depthgrow run`; each field is also a flag and a YAML key (`hf_depthgrow.config`)."""

from __future__ import annotations

import os
import typing
from dataclasses import asdict, dataclass, field, fields

from ..config import shared_field
from ..growth.config import BLOCK_KINDS, INITS
from ..training.tracking import DEFAULT_PROJECT, NONE, REPORT_TO, check_report_to

TRAINABLE = ("new", "new+lora", "full")
CONTROLS = ("auto", "layers", "lora")  # equal-budget controls `run` trains beside the growth (None: no control)
_TYPE_NAMES = {int: "an int", float: "a float", str: "a string", bool: "true or false"}


def _type_error(name: str, value, hint) -> str | None:
    """Why `value` does not fit the annotation `hint` (`None`: it fits); ints count as floats, bools as nothing else."""
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            return f"{name} must be a list of {_TYPE_NAMES[item].split(' ', 1)[-1]}s, got {value!r}"
        return next((_type_error(name, v, item) for v in value if _type_error(name, v, item)), None)
    ok = isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    return None if ok else f"{name} must be {_TYPE_NAMES[hint]}, got {value!r}"


@dataclass
class RunConfig:
    """Settings of `hf-depthgrow run`. Every field is also a command-line flag and a YAML key.

    Example:
        ```python
        >>> cfg = RunConfig(output_dir="runs/demo", train_steps=50)
        >>> result = run_pipeline(cfg)
        ```
    """

    model: str = shared_field("model", "smollm2")
    data: str = shared_field("data", "shakespeare")
    output_dir: str = shared_field("output_dir", "runs/smollm2-shakespeare", more="Every artifact of the run goes here.")
    overwrite: bool = shared_field("overwrite", False)
    block_size: int = shared_field("block_size", 64)
    max_examples: int | None = shared_field("max_examples", 640)
    train_fraction: float | None = shared_field("train_fraction", 0.7)
    held_out_fraction: float = shared_field("held_out_fraction", 0.15, more="Here: evaluation during training and f~_pop.")
    test_fraction: float = shared_field("test_fraction", 0.15, more="Here: the final paired test.")
    split_seed: int | None = shared_field("split_seed", None, more="none: --seed.")
    split_by: str | None = shared_field("split_by", None)
    positions: list[int] | None = field(default=None, metadata={"help": "Grow here instead of where the probe recommends (in Python also a preset string, moved to placement)."})
    placement: str | None = field(default=None, metadata={"help": "Instead of positions: interleave:N, top:N, probe:N (the run's probe, top N by z) or a plan/mergekit YAML file."})
    num_blocks: int = field(default=1, metadata={"help": "How many of the probe's best positions to grow at."})
    force: bool = field(default=False, metadata={"help": "Grow at the best signal even when the probe says 'do not grow'."})
    block: str = field(default="auto", metadata={"help": "native, adapter or auto."})
    init: str = field(default="copy", metadata={"help": "copy or random (native blocks)."})
    probe_max_batches: int | None = field(default=16, metadata={"help": "Probe on at most this many training batches (None: all)."})
    stone_max_batches: int | None = field(default=4, metadata={"help": "Batches of each stepping stone's line search and of f~_pop's held-out direction (f~_S reuses the probe's G_S).",
                                                               "flag": "--stepping-stone-max-batches", "deprecated": ["--stone-max-batches"]})
    selection_max_examples: int | None = field(default=128, metadata={"help": "Training examples on which the fallback rule compares f_new with f~_S (a seeded sample; None: all)."})
    stone_refine_steps: int = field(default=2, metadata={"help": "Parabolic-interpolation steps of each stepping stone's line search after bracketing (one forward pass each).",
                                                          "flag": "--stepping-stone-refine-steps", "deprecated": ["--stone-refine-steps"]})
    route_max_examples: int | None = field(default=64, metadata={"help": "Training examples for rho and B_a of the route terms (None: all; a sample maximum either way)."})
    batch_size: int = field(default=8, metadata={"help": "Batch size of probe, training and evaluation."})
    train_steps: int = field(default=80, metadata={"help": "Optimizer steps.", "flag": "--max-steps", "deprecated": ["--train-steps"]})
    learning_rate: float = field(default=5e-4, metadata={"help": "Peak learning rate of the new blocks."})
    trainable: str = field(default="new", metadata={"help": "new, new+lora or full."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute each layer above the frozen prefix in backward instead of keeping its activations (same gradients, less memory)."})
    eval_steps: int = field(default=40, metadata={"help": "Evaluate on the held-out split every N steps."})
    control: str | None = field(default="auto", metadata={"help": "Equal-budget control trained beside the growth: layers (the existing layers the new blocks copy, same parameter count), lora (matched rank), auto (layers where the counts match, i.e. native blocks; else lora), or none. In this command one control.",
                                                           "flag": "--controls", "deprecated": ["--control"]})
    retention_data: str | None = field(default=None, metadata={"help": "General-domain set for forgetting, e.g. python_docs; none: skip."})
    retention_max_examples: int = field(default=128, metadata={"help": "Use at most this many retention examples."})
    evidence_cache: str | None = field(
        default="auto",
        metadata={"help": "Where the probe, the stepping stones and the original's losses are kept for a later run on the same model, "
                          "data and settings to reuse: auto ($HF_DEPTHGROW_EVIDENCE_CACHE, else evidence/ in $HF_DEPTHGROW_CACHE or "
                          "~/.cache/hf_depthgrow), a folder, or none."},
    )
    delta: float = field(default=0.05, metadata={"help": "Failure probability of each interval (confidence 1 - delta)."})
    loss_bound: float | None = field(default=None, metadata={"help": "A-priori bound B of a per-example loss (None: from the data, with a warning)."})
    seed: int = field(default=0, metadata={"help": "Seeds the split (unless --split-seed), blocks, training and the bootstrap."})
    push_to_hub: str | None = field(default=None, metadata={"help": "Push the result to this repo id (explicit; never pushed otherwise)."})
    hub_private: bool | None = field(default=None, metadata={"help": "Create the Hub repo as private."})
    hub_endpoint: str | None = field(default=None, metadata={"help": "Another Hub endpoint (default: HF_ENDPOINT or huggingface.co)."})
    license: str | None = field(default=None, metadata={"help": "License id for the model card (a grown model inherits its base's)."})
    progress: bool = shared_field("progress", True)
    report_to: list[str] = field(
        default_factory=lambda: [NONE],
        metadata={"help": "Experiment trackers (Accelerate's): tensorboard, wandb (several allowed) or none. Logs the probe, "
                          "training and held-out losses, and the test-risk delta with its intervals.", "choices": [NONE, *REPORT_TO]},
    )
    logging_dir: str | None = field(default=None, metadata={"help": "Where trackers write (runs probe, grown, control); default: <output_dir>/logs."})
    project_name: str = field(default=DEFAULT_PROJECT, metadata={"help": "Project name in the trackers (the W&B project)."})
    trust_remote_code: bool = shared_field("trust_remote_code", False)
    quantize: str | None = field(
        default=None,
        metadata={"help": "Load the base quantised by bitsandbytes, 4bit (NF4) or 8bit, as a frozen base: only the new blocks train "
                          "(trainable new; the control arm auto resolves to none, since the base's layers cannot train)."},
    )

    def __post_init__(self):
        # `positions="interleave:8"` from Python: the flag and YAML key hold ints only, so presets live in `placement`.
        if isinstance(self.positions, str):
            if self.placement is not None:
                raise ValueError(f"give positions or placement, not both (got {self.positions!r} and {self.placement!r})")
            self.positions, self.placement = None, self.positions
        # From Python, "none" means what the flag's `none` means: switched off.
        for name in ("control", "retention_data", "evidence_cache"):
            if isinstance(getattr(self, name), str) and getattr(self, name).strip().lower() in ("none", "null"):
                setattr(self, name, None)
        self.report_to = check_report_to(self.report_to)  # one name or "none" from Python, as the flag takes it
        # Types first: a string learning rate must fail here, not after the probe has run.
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            problem = _type_error(f.name, getattr(self, f.name), hints[f.name])
            if problem:
                raise ValueError(problem)
        for name in ("train_fraction", "held_out_fraction", "test_fraction", "learning_rate", "delta"):
            if getattr(self, name) is not None:
                setattr(self, name, float(getattr(self, name)))
        self._check_values()

    def _check_values(self):
        if self.block not in BLOCK_KINDS:
            raise ValueError(f"block must be one of {BLOCK_KINDS}, got {self.block!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        from ..data.sources import split_fractions

        split_fractions(self.train_fraction, self.held_out_fraction, self.test_fraction, every_part="run")
        for name in ("route_max_examples", "selection_max_examples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.stone_refine_steps < 0:
            raise ValueError(f"stone_refine_steps must be >= 0, got {self.stone_refine_steps}")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable must be one of {TRAINABLE}, got {self.trainable!r}")
        self._check_control()
        if self.positions is not None and (not self.positions or min(self.positions) < 0):
            raise ValueError(f"positions must be a non-empty list of ints >= 0, got {self.positions}")
        if self.placement is not None:
            self._check_placement()
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        for name in ("max_examples", "probe_max_batches", "stone_max_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.loss_bound is not None and not self.loss_bound > 0:
            raise ValueError(f"loss_bound must be > 0 or None, got {self.loss_bound}")
        for name in ("block_size", "batch_size", "train_steps", "num_blocks", "eval_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        for name in ("seed", "split_seed"):
            if getattr(self, name) is not None and getattr(self, name) < 0:  # numpy refuses it much later, without naming the setting
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.push_to_hub is not None and not self.push_to_hub.strip():
            raise ValueError("push_to_hub needs a repo id such as 'me/grown-smollm2'")
        if self.loss_bound is not None:
            self.loss_bound = float(self.loss_bound)
        if not self.project_name.strip():
            raise ValueError("project_name must be a non-empty string")

    def _check_control(self):
        if self.control is not None and self.control not in CONTROLS:
            raise ValueError(f"control must be one of {CONTROLS} or none, got {self.control!r}")
        # The control is matched to what the growth trains; with LoRA or everything training too, nothing matches it.
        if self.control is not None and self.trainable != "new":
            raise ValueError(
                f"control {self.control!r} is matched to the new blocks, so it needs trainable='new' (got {self.trainable!r}); pass control: none"
            )
        if self.control == "layers" and self.block == "adapter":
            raise ValueError("control 'layers' trains whole existing layers, which adapter blocks do not match in size; use control: lora or none")
        if self.quantize is not None:
            self._check_quantize()
        if self.retention_data is not None and not self.retention_data.strip():
            raise ValueError("retention_data needs a data source such as 'python_docs' (or none)")
        if self.evidence_cache is not None and not self.evidence_cache.strip():
            raise ValueError("evidence_cache needs auto, a folder or none")
        if self.retention_max_examples < 1:
            raise ValueError(f"retention_max_examples must be >= 1, got {self.retention_max_examples}")

    def _check_quantize(self):
        if self.quantize not in ("4bit", "8bit"):
            raise ValueError(f"quantize must be 4bit or 8bit, got {self.quantize!r}")
        if self.trainable != "new":
            raise ValueError(f"quantize keeps the base frozen, so it needs trainable='new' (got {self.trainable!r})")
        if self.control == "auto":
            self.control = None  # both controls train the base's own layers, which stay quantised and frozen
        elif self.control is not None:
            raise ValueError(
                f"control {self.control!r} trains the base's own layers, which a quantised base keeps frozen: pass control: none with quantize"
            )

    def _check_placement(self):
        # The spec's form is checked now (before loading anything); its range needs the model's depth.
        from ..growth.placement import check_placement

        if self.positions is not None:
            raise ValueError(f"give positions or placement, not both (got {self.positions} and {self.placement!r})")
        check_placement(self.placement)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides) -> "RunConfig":
        """The config a YAML file describes (keys are field names); `overrides` win over the file.

        Example:
            ```python
            >>> cfg = RunConfig.from_yaml("runs/demo/config.yaml", train_steps=10)
            ```
        """
        from ..config import load_config

        return load_config(path, cls, **overrides)[0]

    @property
    def resolved_split_seed(self) -> int:
        """The seed of the split and of which examples load: `split_seed`, else `seed`."""
        return self.seed if self.split_seed is None else self.split_seed

    def to_dict(self) -> dict:
        return asdict(self)
