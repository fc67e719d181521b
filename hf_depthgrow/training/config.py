"""`TrainConfig`: every setting of the trainer in one validated dataclass (trl's `x_config.py` pattern)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..config import shared_field
from ..utils import check_int, is_int
from .schedules import SCHEDULERS
from .tracking import DEFAULT_PROJECT, NONE, REPORT_TO, check_logging_dir, check_report_to

TRAINABLE = ("new", "new+lora", "full", "layers", "lora")
# Modes that train a model without new blocks (the control arms of `hf_depthgrow.comparison`).
UNGROWN_MODES = ("full", "layers", "lora")
MIXED_PRECISION = ("no", "fp16", "bf16")
PREFIX_CACHE = ("auto", "memory", "disk", "off")
CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
CHUNKED_LOSS = ("auto", "on", "off")
# Fields a resumed run may set differently from the run that wrote the checkpoint: they change
# neither the weights nor the data order. Every other field is part of the run fingerprint.
RESUME_MAY_CHANGE = (
    "per_device_train_batch_size", "per_device_eval_batch_size", "eval_steps", "logging_steps", "progress_bar",
    "prefix_cache", "prefix_cache_dir", "prefix_cache_batch_size", "merge_lora", "output_dir", "save_steps",
    "save_total_limit", "save_final_model", "resume_from_checkpoint", "ddp_timeout", "stop_after_step",
    "report_to", "logging_dir", "project_name", "run_name", "gradient_checkpointing",
)
BOOL_FIELDS = ("merge_lora", "progress_bar", "fallback", "save_final_model", "gradient_checkpointing")


def _require(cond, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _is_num(v) -> bool:  # finite: inf/NaN would train on silently to a non-finite model
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class TrainConfig:
    r"""Settings of `hf_depthgrow.train` / `GrownTrainer` and of `hf-depthgrow train`.

    Parameters are grouped as in trl's configs; each field's `help` says the same in one line.

    > Trainable set

    trainable (`str`, defaults to `"new"`):
        `"new"`: only the inserted blocks train (every original weight stays bit-identical).
        `"new+lora"`: the new blocks in full plus PEFT LoRA on the original layers above the lowest
        insertion. `"full"`: every parameter. Two modes train a model that was *not* grown, as the
        equal-budget controls of `hf_depthgrow.comparison`: `"layers"` trains the existing layers
        `trainable_layers` in full (everything below the lowest one stays frozen and is cached);
        `"lora"` trains LoRA on the linear layers of the whole stack (`lora_target_modules` filters them).
    trainable_layers (`list[int]` or `None`):
        Stack indices of the existing layers `"layers"` trains.
    lora_r, lora_alpha, lora_dropout (`int`, `int`, `float`):
        LoRA rank, scaling numerator and dropout (only with `"new+lora"`).
    lora_target_modules (`list[str]` or `None`):
        Name suffixes of the linear layers to adapt (e.g. `["q_proj", "v_proj"]`); `None` adapts every
        linear layer of the original layers above the lowest insertion.
    merge_lora (`bool`, defaults to `True`):
        Merge LoRA into the weights at the end, so the result is a plain grown model.

    > Optimisation

    learning_rate, weight_decay, adam_beta1, adam_beta2, adam_epsilon:
        AdamW over the trainable parameters only (no optimizer state for frozen ones). Biases and
        norm weights get no weight decay.
    lr_scheduler (`str`): `"cosine"`, `"linear"`, `"constant"` or `"wsd"` (warmup-stable-decay: the peak
        rate held, then a cosine decay over the last `decay_ratio` of the steps), after `warmup_steps`
        (or `warmup_ratio` of the steps) of linear warm-up.
    max_steps (`int`): optimizer steps; `-1` derives them from `num_train_epochs`.
    per_device_train_batch_size, gradient_accumulation_steps: the global batch is
        `per_device_train_batch_size * num_processes * gradient_accumulation_steps` examples.
    max_grad_norm (`float` or `None`): gradient clipping; `None` or `0` switches it off.
    mixed_precision (`str` or `None`): `"no"`, `"fp16"`, `"bf16"`; `None` takes the
        `accelerate launch` configuration.
    gradient_checkpointing (`bool`, defaults to `False`): keep only each layer's input from the lowest
        layer a gradient flows through, and recompute the layer in backward (non-reentrant, so new blocks
        above a frozen or cached prefix get their full gradient; `activation_checkpointing.py`). Same
        gradients, about one more forward of those layers per step, activation memory of one layer
        instead of all of them.
    seed (`int`): seeds LoRA init, dropout and the data order.

    > Evaluation and logging

    eval_steps (`int`): evaluate on the held-out split every N steps (`0`: only before and after).
    logging_steps (`int`): log the training loss every N steps.
    progress_bar (`bool`): a tqdm bar with loss and tokens/s (examples/s for classifiers), main process only.
    report_to (`list[str]`, defaults to `["none"]`): experiment trackers, through Accelerate's
        (`Accelerator(log_with=...)`): `"tensorboard"`, `"wandb"`, several, or `"none"` (a string is one name).
        Logged: `train/loss`, `train/learning_rate`, `train/grad_norm` and throughput every `logging_steps`,
        `eval/loss` whenever the held-out split is evaluated, the fallback rule's losses and `Delta_ERM` at
        the end (`hf_depthgrow.training.tracking`).
    logging_dir (`str` or `None`): where the trackers write (TensorBoard: `<logging_dir>/<run_name>/`);
        default `<output_dir>/runs`. TensorBoard needs one of the two.
    project_name (`str`): the W&B project. run_name (`str` or `None`): the run's name in the trackers;
        default: the output_dir's folder name (`"train"` without one).

    > Frozen-prefix cache

    prefix_cache (`str`, defaults to `"auto"`): `"memory"`, `"disk"` or `"off"`. When nothing below the
        lowest inserted block trains, `z = f_bot(x)` is computed once per example and training runs
        only the layers from there on. `"auto"`: `"memory"` where valid, else `"off"`. A `"memory"` cache lives
        on the GPU while it takes at most a quarter of its free memory, else in CPU memory.
    prefix_cache_dtype (`str`): storage dtype of the cache; `"auto"` keeps the dtype the prefix produces
        (exact); `"bfloat16"`/`"float16"` halve the memory at a rounding of z.
    prefix_cache_dir (`str` or `None`): where `"disk"` spills (default: `<output_dir>/prefix_cache`, or a temp dir).
    prefix_cache_batch_size (`int` or `None`): batch size of the up-front prefix pass (default: the eval batch size).

    > Fallback rule (docs/theory.md §4, Condition 2)

    fallback (`bool`, defaults to `True`): after training, compare the training loss `L_S` of the trained
        model with that of the stepping stone (or of the original model) and return the better one.
    selection_max_examples (`int` or `None`): compute `L_S` on a fixed seeded subset of this many
        training examples (`None`: the whole training set).

    > Checkpoints

    output_dir (`str` or `None`): checkpoints, logs and the final model (`<output_dir>/model`).
    save_steps (`int`): write a checkpoint every N steps (`0`: none). Checkpoints are atomic.
    save_total_limit (`int` or `None`): keep only the last N checkpoints.
    save_final_model (`bool`): save the selected model with `save_pretrained` at the end.
    resume_from_checkpoint (`str` or `None`): a checkpoint folder, or `"latest"` (the newest under output_dir).
        Only a checkpoint of the same run resumes: same model, training data and training settings.
        A resumed run may change only `RESUME_MAY_CHANGE` (the per-device batch size if the global
        micro-batch stays, eval/logging/progress/prefix-cache/save settings, `merge_lora`, `ddp_timeout`,
        `stop_after_step`); any other change (learning rate, seed, `max_steps`, ...) is refused, naming
        the fields. To train longer, start a new run from the saved model. A run never prunes
        checkpoints it did not write, and refuses to write checkpoints beside another run's.
        One run at a time per output_dir (a lock file `.hf_depthgrow.lock`; a dead run's lock is taken over).

    > Distributed and debugging

    ddp_timeout (`int`): seconds before a collective call times out.
    stop_after_step (`int` or `None`): debugging: hard-exit the process (`os._exit`) right after this step
        (and its checkpoint, if one is due), as a crash would.

    Example:
        ```python
        >>> from hf_depthgrow.training.config import TrainConfig
        >>> TrainConfig(trainable="new+lora", max_steps=100, learning_rate=1e-4).trainable
        'new+lora'
        ```
    """

    # trainable set
    trainable: str = field(default="new", metadata={"help": "new, new+lora, full, layers or lora.", "choices": list(TRAINABLE)})
    trainable_layers: list[int] | None = field(
        default=None, metadata={"help": "Stack indices of the existing layers trainable='layers' trains."}
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank (new+lora)."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (new+lora)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout (new+lora)."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Name suffixes of linear layers to adapt; default: all above the lowest insertion."}
    )
    merge_lora: bool = field(default=True, metadata={"help": "Merge LoRA into the weights at the end."})
    # optimisation
    learning_rate: float = field(default=1e-4, metadata={"help": "Peak learning rate of AdamW."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (not on biases and norms)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    lr_scheduler: str = field(default="cosine", metadata={"help": "cosine, linear, constant or wsd (warmup-stable-decay).", "choices": list(SCHEDULERS)})
    decay_ratio: float = field(default=0.2, metadata={"help": "wsd: the decay's share of the steps (the rest after warm-up is stable)."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps."})
    warmup_ratio: float = field(default=0.0, metadata={"help": "Warm-up as a share of the steps (if warmup_steps is 0)."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; -1: from num_train_epochs."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Epochs, when max_steps is -1."})
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Examples per process per micro-batch.", "flag": "--batch-size", "deprecated": ["--per-device-train-batch-size"]}
    )
    per_device_eval_batch_size: int | None = field(
        default=None,
        metadata={"help": "Eval batch size; default: the train one.", "flag": "--eval-batch-size", "deprecated": ["--per-device-eval-batch-size"]},
    )
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    max_grad_norm: float | None = field(default=1.0, metadata={"help": "Clip gradients to this norm; None/0: off."})
    mixed_precision: str | None = field(
        default=None, metadata={"help": "no, fp16 or bf16; default: the accelerate launch config."}
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute each layer above the frozen prefix in backward instead of keeping its activations "
                          "(non-reentrant: same gradients, less memory, about one more forward)."},
    )
    seed: int = field(default=0, metadata={"help": "Seed of LoRA init, dropout and data order."})
    # evaluation and logging
    eval_steps: int = field(default=0, metadata={"help": "Evaluate every N steps; 0: before and after only."})
    logging_steps: int = field(default=10, metadata={"help": "Log the training loss every N steps."})
    progress_bar: bool = field(default=True, metadata={"help": "Show a tqdm progress bar (main process).", "flag": "--progress", "deprecated": ["--progress-bar"]})
    report_to: list[str] = field(
        default_factory=lambda: [NONE],
        metadata={"help": "Experiment trackers: tensorboard, wandb (several allowed) or none.", "choices": [NONE, *REPORT_TO]},
    )
    logging_dir: str | None = field(default=None, metadata={"help": "Where trackers write (TensorBoard: <logging_dir>/<run_name>); default: <output_dir>/runs."})
    project_name: str = field(default=DEFAULT_PROJECT, metadata={"help": "Project name in the trackers (the W&B project)."})
    run_name: str | None = field(default=None, metadata={"help": "Run name in the trackers; default: the output_dir's folder name."})
    # prefix cache
    prefix_cache: str = field(default="auto", metadata={"help": "auto, memory, disk or off.", "choices": list(PREFIX_CACHE)})
    prefix_cache_dtype: str = field(
        default="auto", metadata={"help": "Storage dtype: auto (exact), float32, bfloat16, float16.", "choices": list(CACHE_DTYPES)}
    )
    prefix_cache_dir: str | None = field(default=None, metadata={"help": "Folder for prefix_cache=disk."})
    prefix_cache_batch_size: int | None = field(default=None, metadata={"help": "Batch size of the prefix pass."})
    # causal-LM loss without the full logits (hf_depthgrow.chunked_loss)
    chunked_loss: str = field(
        default="auto",
        metadata={"help": "Cross-entropy over chunks of tokens, one chunk's logits alive at a time: auto (where vocabulary x "
                          "tokens is large), on or off (the plain head).", "choices": list(CHUNKED_LOSS)},
    )
    loss_chunk_size: int | None = field(default=None, metadata={"help": "Tokens per chunk where the loss is chunked; None: from the vocabulary."})
    # fallback rule
    fallback: bool = field(default=True, metadata={"help": "Select the better of trained/stepping-stone/original by L_S."})
    selection_max_examples: int | None = field(
        default=None, metadata={"help": "L_S on a seeded subset of this many training examples; None: all."}
    )
    # checkpoints
    output_dir: str | None = shared_field("output_dir", None, more="Checkpoints, logs and <output_dir>/model go here.")
    save_steps: int = field(default=0, metadata={"help": "Checkpoint every N steps; 0: none."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Keep the last N checkpoints; None: all."})
    save_final_model: bool = field(default=True, metadata={"help": "save_pretrained the selected model at the end."})
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "A checkpoint folder to continue from, or 'latest' (the newest under --output-dir)."}
    )
    # distributed and debugging
    ddp_timeout: int = field(default=1800, metadata={"help": "Seconds before a collective call times out."})
    stop_after_step: int | None = field(default=None, metadata={"help": "Debug: os._exit right after this step.", "hidden": True})

    def __post_init__(self):
        # Every check raises one ValueError naming its field; the first bad field (in this order) is reported.
        self._check_choices()
        self._check_targets()
        self._check_counts()
        self._check_rates()
        self._check_outputs()

    def _check_choices(self) -> None:
        for name in BOOL_FIELDS:  # a string such as "false" would be truthy
            _require(isinstance(getattr(self, name), bool), f"{name} must be True or False, got {getattr(self, name)!r}")
        _require(self.trainable in TRAINABLE, f"trainable must be one of {TRAINABLE}, got {self.trainable!r}")
        _require(self.lr_scheduler in SCHEDULERS, f"lr_scheduler must be one of {SCHEDULERS}, got {self.lr_scheduler!r}")
        _require(
            self.mixed_precision is None or self.mixed_precision in MIXED_PRECISION,
            f"mixed_precision must be None or one of {MIXED_PRECISION}, got {self.mixed_precision!r}",
        )
        _require(self.prefix_cache in PREFIX_CACHE, f"prefix_cache must be one of {PREFIX_CACHE}, got {self.prefix_cache!r}")
        _require(self.prefix_cache_dtype in CACHE_DTYPES, f"prefix_cache_dtype must be one of {CACHE_DTYPES}, got {self.prefix_cache_dtype!r}")
        _require(
            not (self.trainable == "full" and self.prefix_cache in ("memory", "disk")),
            "prefix_cache needs a frozen prefix, but trainable='full' trains the layers below the new blocks; "
            "use prefix_cache='auto' or 'off'.",
        )
        _require(
            not (self.trainable == "lora" and self.prefix_cache in ("memory", "disk")),
            "prefix_cache needs a frozen prefix, but trainable='lora' adapts every layer; use prefix_cache='auto' or 'off'.",
        )

    def _check_targets(self) -> None:
        if self.trainable == "layers":
            layers = self.trainable_layers
            _require(
                isinstance(layers, (list, tuple)) and layers and all(is_int(i) and i >= 0 for i in layers) and len(set(layers)) == len(layers),
                f"trainable='layers' needs trainable_layers, a non-empty list of distinct layer indices >= 0, got {layers!r}",
            )
            self.trainable_layers = sorted(layers)
        else:
            _require(self.trainable_layers is None, f"trainable_layers is only used with trainable='layers' (trainable={self.trainable!r})")
        _require(
            self.lora_target_modules is None
            or (isinstance(self.lora_target_modules, (list, tuple)) and self.lora_target_modules and all(isinstance(m, str) and m for m in self.lora_target_modules)),
            f"lora_target_modules must be None or a non-empty list of names, got {self.lora_target_modules!r}",
        )
        if self.lora_target_modules is not None:
            self.lora_target_modules = list(self.lora_target_modules)

    def _check_counts(self) -> None:
        for name in ("lora_r", "lora_alpha", "per_device_train_batch_size", "gradient_accumulation_steps", "ddp_timeout"):
            check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "eval_steps", "save_steps", "seed"):
            check_int(name, getattr(self, name), 0)
        check_int("logging_steps", self.logging_steps, 1)
        for name in ("per_device_eval_batch_size", "prefix_cache_batch_size", "selection_max_examples", "save_total_limit", "stop_after_step"):
            check_int(name, getattr(self, name), 1, allow_none=True)
        _require(is_int(self.max_steps) and (self.max_steps == -1 or self.max_steps >= 1), f"max_steps must be -1 or >= 1, got {self.max_steps!r}")

    def _check_rates(self) -> None:
        _require(_is_num(self.num_train_epochs) and self.num_train_epochs > 0, f"num_train_epochs must be a finite number > 0, got {self.num_train_epochs!r}")
        _require(_is_num(self.learning_rate) and self.learning_rate > 0, f"learning_rate must be a finite number > 0, got {self.learning_rate!r}")
        _require(_is_num(self.weight_decay) and self.weight_decay >= 0, f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        for name in ("adam_beta1", "adam_beta2"):
            _require(_is_num(getattr(self, name)) and 0 <= getattr(self, name) < 1, f"{name} must be a number in [0, 1), got {getattr(self, name)!r}")
        _require(_is_num(self.adam_epsilon) and self.adam_epsilon > 0, f"adam_epsilon must be a finite number > 0, got {self.adam_epsilon!r}")
        _require(_is_num(self.warmup_ratio) and 0 <= self.warmup_ratio < 1, f"warmup_ratio must be a number in [0, 1), got {self.warmup_ratio!r}")
        _require(_is_num(self.decay_ratio) and 0 < self.decay_ratio <= 1, f"decay_ratio must be a number in (0, 1], got {self.decay_ratio!r}")
        if self.lr_scheduler == "wsd" and is_int(self.max_steps) and self.max_steps > 0 and is_int(self.warmup_steps):
            from .schedules import check_wsd

            check_wsd(self.max_steps, self.warmup_steps or math.ceil(self.warmup_ratio * self.max_steps), self.decay_ratio)
        _require(not (self.warmup_steps and self.warmup_ratio), "set warmup_steps or warmup_ratio, not both")
        _require(_is_num(self.lora_dropout) and 0 <= self.lora_dropout < 1, f"lora_dropout must be a number in [0, 1), got {self.lora_dropout!r}")
        _require(
            self.max_grad_norm is None or (_is_num(self.max_grad_norm) and self.max_grad_norm >= 0),
            f"max_grad_norm must be None or a finite number >= 0, got {self.max_grad_norm!r}",
        )

    def _check_outputs(self) -> None:
        _require(
            not (self.save_steps and not self.output_dir),
            "save_steps > 0 needs output_dir (checkpoints are written there)",
        )
        _require(
            not (self.resume_from_checkpoint == "latest" and not self.output_dir),
            "resume_from_checkpoint='latest' looks under output_dir, which is not set",
        )
        self._check_chunked_loss()
        self.report_to = check_report_to(self.report_to)
        check_logging_dir(self.report_to, self.resolved_logging_dir(), "neither logging_dir nor output_dir (default <output_dir>/runs) is set")
        for name in ("project_name", "run_name"):
            value = getattr(self, name)
            _require((value is None and name == "run_name") or (isinstance(value, str) and value.strip()), f"{name} must be a non-empty string, got {value!r}")

    def _check_chunked_loss(self) -> None:
        if self.chunked_loss not in CHUNKED_LOSS:
            raise ValueError(f"chunked_loss must be one of {CHUNKED_LOSS}, got {self.chunked_loss!r}")
        size = self.loss_chunk_size
        check_int("loss_chunk_size", size, 1, allow_none=True)
        if size is not None and self.chunked_loss == "off":
            raise ValueError(f"loss_chunk_size={size} sizes the chunks of a chunked loss, but chunked_loss is 'off'")

    @property
    def loss_chunk(self):
        """What `hf_depthgrow.chunked_loss` takes as `chunk_size`: `"auto"`, `"on"`, tokens per chunk, or `None` (plain)."""
        if self.chunked_loss == "off":
            return None
        return self.loss_chunk_size or self.chunked_loss

    def resolved_logging_dir(self) -> str | None:
        """Where the trackers write: `logging_dir`, else `<output_dir>/runs`, else `None`."""
        if self.logging_dir:
            return os.fspath(self.logging_dir)
        return os.path.join(self.output_dir, "runs") if self.output_dir else None

    def resolved_run_name(self) -> str:
        """The run's name in the trackers: `run_name`, else the output_dir's folder name, else `"train"`."""
        return self.run_name or (Path(self.output_dir).resolve().name if self.output_dir else "") or "train"

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json_string(self) -> str:
        from ..utils import package_version

        return json.dumps({**self.to_dict(), "hf_depthgrow_version": package_version()}, indent=2, sort_keys=True)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}
