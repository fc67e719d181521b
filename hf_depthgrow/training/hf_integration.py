"""Training a grown model with `transformers.Trainer` or trl's `SFTTrainer` instead of `hf_depthgrow.train`.

Three pieces, each reusing what `hf_depthgrow.train` does:

- `prepare_grown_model(model)`: freeze everything but the new blocks (`trainable="new"` of
  `training/trainable.py`) and make the model's saves complete (`keep_growth_on_save`); returns the
  number of trainable parameters. A standard trainer builds its optimizer from the parameters that
  require grad, so the original weights stay bit-identical.
- `keep_growth_on_save(model)`: the growth record travels in `config.json`, which a plain
  `save_pretrained` keeps, but adapter blocks also need `depthgrow_adapters.safetensors` beside the
  weights for `hf_depthgrow.load_pretrained` to rebuild them; `Trainer.save_model` and every checkpoint
  call `model.save_pretrained`, so that method writes the file too. The adapter weights also stay in the
  main checkpoint, where `Trainer(resume_from_checkpoint=...)` reads them.
- `FallbackCallback(eval_data)`: the fallback rule of `training/selection.py` at the end of training:
  the trained model `f_new` against the original `f_old` (new blocks bypassed) on `eval_data`; if
  `f_new` is worse the new blocks go back to zero init, so the model computes exactly `f_old`. A
  non-finite loss or weight stops training with `NonFiniteTrainingLossError`. The decision is stored
  in the model config under `depth_growth_fallback`, so every folder saved afterwards says what was selected.

Example:
    ```python
    >>> from transformers import Trainer, TrainingArguments
    >>> from hf_depthgrow import grow_depth
    >>> from hf_depthgrow.training import FallbackCallback, prepare_grown_model
    >>> grow_depth(model, [2])                    # a 4-layer Llama, hidden 64, MLP 128
    >>> prepare_grown_model(model)                # one new layer trains
    36992
    >>> trainer = Trainer(model=model, args=TrainingArguments("out", max_steps=8, use_cpu=True, report_to="none"),
    ...                   train_dataset=train_rows, callbacks=[FallbackCallback(held_out_rows)])
    >>> trainer.train()
    >>> trainer.save_model("out/model")           # hf_depthgrow.load_pretrained("out/model") rebuilds it
    ```
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import TrainerCallback

from ..growth import adapter
from ..growth.record import growth_record
from ..growth.engine import new_block_parameters
from ..growth.families import residual_output_modules
from ..growth.towers import resolve_family
from ..growth.record import RECORD_KEY
from ..hub.serialization import ADAPTER_WEIGHTS
from ..losses import is_causal_lm
from ..utils import check_int, json_safe, package_version
from .config import TrainConfig
from .data_order import training_rows
from .guards import NonFiniteTrainingLossError, nonfinite_weights
from .selection import candidate_loss, initial_weights, pick, selected_model
from .trainable import setup_trainable

__all__ = ["FALLBACK_KEY", "FallbackCallback", "FallbackDecision", "keep_growth_on_save", "prepare_grown_model", "unwrap_autocast",
           "write_growth_files"]

FALLBACK_KEY = "depth_growth_fallback"  # the config key holding the fallback decision


def _require_grown(model: nn.Module, who: str) -> list[tuple[str, nn.Parameter]]:
    """The new blocks' `(name, parameter)`; one `ValueError` for anything that is not a grown model."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"{who} needs a transformers model grown by hf_depthgrow.grow_depth, got {type(model).__name__}")
    named = list(new_block_parameters(model)) if growth_record(model) is not None else []
    if not named:
        raise ValueError(f"{who}: {type(model).__name__} has no new blocks (no growth record); call hf_depthgrow.grow_depth first")
    return named


def _grown_model(model: nn.Module) -> nn.Module:
    """The grown transformers model: `model` itself, or the one inside a `depthgrow` PEFT model (grown in place).

    `SFTTrainer(peft_config=DepthGrowConfig(...))` hands callbacks the `PeftModel`; its base model is the grown
    model, with the very parameters the trainer optimises.
    """
    config = getattr(model, "peft_config", None)
    if isinstance(config, dict) and config and all(getattr(c, "peft_type", None) == "DEPTHGROW" for c in config.values()):
        return model.get_base_model()
    return model


# ------------------------------------------------------------------ preparing and saving


def prepare_grown_model(model: nn.Module) -> int:
    """Freeze everything but the new blocks, make saves complete, and return the trainable parameter count.

    Call it before building the `Trainer`/`SFTTrainer` (whose optimizer takes the parameters that require
    grad). Unlike `hf_depthgrow.train`, a standard trainer puts the whole model in train mode, so dropout
    of the frozen layers is active during training (most decoder configs set it to 0); frozen weights
    never change either way.

    Raises:
        ValueError: the model was not grown (no growth record or no new block).

    Example:
        ```python
        >>> model = grow_depth(tiny_model("llama"), [2])
        >>> prepare_grown_model(model) == sum(p.numel() for _, p in new_block_parameters(model))
        True
        ```
    """
    _require_grown(model, "prepare_grown_model")
    trainable = setup_trainable(model, TrainConfig(trainable="new"))
    keep_growth_on_save(model)
    return sum(p.numel() for _, p in trainable.named)


def _adapter_state(model: nn.Module, state_dict: dict | None) -> dict[str, torch.Tensor]:
    # The adapter tensors under the model's own parameter names, as `hf_depthgrow.save_pretrained` writes them;
    # from the gathered `state_dict` when the trainer passed one (FSDP, DeepSpeed).
    source = state_dict if state_dict is not None else model.state_dict()
    return {k: v.detach().to("cpu").contiguous() for k, v in source.items() if f".{adapter.PRE}." in k or f".{adapter.POST}." in k}


def write_growth_files(model: nn.Module, folder: str | os.PathLike, *, state_dict: dict | None = None) -> Path:
    """Add what `hf_depthgrow.load_pretrained` needs to a folder written by plain `save_pretrained`.

    The growth record goes into `config.json` (rewritten only if it lacks it), and for adapter blocks
    `depthgrow_adapters.safetensors` is written beside the weights (via a temporary file and a rename).

    Example:
        ```python
        >>> model.save_pretrained("out")            # plain transformers
        >>> write_growth_files(model, "out")
        >>> load_pretrained("out")                    # adapters rebuilt
        ```
    """
    folder = Path(folder)
    record = growth_record(model)
    if record is None:
        return folder
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} holds no config.json: save the model there first")
    if RECORD_KEY not in json.loads(config_path.read_text(encoding="utf-8")):
        model.config.save_pretrained(str(folder))
    if record.adapters:
        tmp = folder / f".{ADAPTER_WEIGHTS}.tmp-{os.getpid()}"
        save_file(_adapter_state(model, state_dict), str(tmp), metadata={"format": "pt"})
        os.replace(tmp, folder / ADAPTER_WEIGHTS)
    return folder


def _save_pretrained_grown(self, save_directory, *args, **kwargs):
    # Bound to one model by `keep_growth_on_save` (a bound method, so `copy.deepcopy` rebinds it to the copy).
    type(self).save_pretrained(self, save_directory, *args, **kwargs)
    bound = inspect.signature(type(self).save_pretrained).bind(self, save_directory, *args, **kwargs)
    bound.apply_defaults()
    if bound.arguments.get("is_main_process", True):
        write_growth_files(self, save_directory, state_dict=bound.arguments.get("state_dict"))


def keep_growth_on_save(model: nn.Module) -> nn.Module:
    """Make `model.save_pretrained` (what `Trainer.save_model` and checkpoints call) also run `write_growth_files`.

    Idempotent; returns the model.

    Example:
        ```python
        >>> keep_growth_on_save(model)
        >>> Trainer(model=model, args=args, train_dataset=rows).save_model("out")   # loads with load_pretrained
        ```
    """
    _require_grown(model, "keep_growth_on_save")
    current = model.__dict__.get("save_pretrained")
    if not (isinstance(current, types.MethodType) and current.__func__ is _save_pretrained_grown):
        model.save_pretrained = types.MethodType(_save_pretrained_grown, model)
    return model


# ------------------------------------------------------------------ the fallback rule as a callback


@dataclass
class FallbackDecision:
    """What `FallbackCallback` selected, stored as `model.config.depth_growth_fallback` (and so in `config.json`)."""

    selected: str  # "new" (the trained blocks kept) or "old" (new blocks back at zero init: the original function)
    losses: dict  # mean loss of "new" and "old" on the selection data
    delta: float  # losses["old"] - losses["new"]: > 0 when training helped
    data: str  # what the losses were measured on
    num_examples: int
    step: int  # the optimizer step training ended at
    reset: str | None  # how the blocks were put back ("starting weights" / "residual outputs zeroed"), None if kept
    hf_depthgrow_version: str

    def to_dict(self) -> dict:
        """A JSON-safe dict (a non-finite loss of `f_old` written as `"inf"`/`"nan"`), the form stored in the config."""
        return json_safe(asdict(self))


class _Processes:
    """What `forward.dataset_loss` needs of an accelerator, from the process group the trainer set up.

    Everything but `device`, `autocast` and `reduce` is read from accelerate's `PartialState` (process
    count and index, `distributed_type`, ...). Losses are computed in the model's dtype (no autocast):
    the rule compares two functions, not a training step.
    """

    def __init__(self, device: torch.device):
        from accelerate import PartialState

        self.device, self._state = device, PartialState()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._state, name)

    def autocast(self):
        return contextlib.nullcontext()

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        from accelerate.utils import reduce

        return reduce(tensor, reduction=reduction)


def unwrap_autocast(model: nn.Module) -> nn.Module:
    """Remove the mixed-precision wrapper accelerate leaves on `model.forward` after training; the same model, in place.

    With `bf16=True` or `fp16=True` (`SFTConfig`'s default is bf16, also on CPU), `Trainer` hands the model to
    accelerate's `prepare`, which replaces `model.forward` by the same forward under `torch.autocast`. The wrapper
    stays after `train()` returns: the weights are float32 and are saved exactly, but the model in memory keeps
    computing its matrix products in bf16, so its logits differ from those of its own saved copy (0.17 on the tiny
    Llama of tests/test_hf_trainer.py after 4 steps). This restores the plain forward; a later `trainer.evaluate()`
    still autocasts through its own context manager.

    Example:
        ```python
        >>> trainer.train()                          # SFTConfig(bf16=True)
        >>> model = unwrap_autocast(trainer.model)   # float32 forward again: equal to the saved copy
        ```
    """
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_fp32_wrapper=False)


def _zero_init_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters `grow_depth` zeroes (native residual output projections, adapter `W_out`): all zero means `f_old`."""
    record = growth_record(model)
    spec, stack, _ = resolve_family(model)
    params = [p for i in record.native_indices for m in residual_output_modules(spec, stack[i]) for p in m.parameters(recurse=False)]
    blocks = [b for layer in stack for hosted in adapter.hosted_blocks(layer).values() for b in hosted]
    return params + [p for b in blocks for p in b.w_out.parameters()]


class FallbackCallback(TrainerCallback):
    """The fallback rule for `Trainer`/`SFTTrainer`: keep the trained blocks only if they beat the original on `eval_data`.

    At the end of training the mean loss of the trained model (`f_new`) and of the same model with its new
    blocks bypassed (`f_old`, exactly the original) is computed on `eval_data`, and
    `hf_depthgrow.training.selection.pick` decides (ties keep `f_new`). If `f_old` wins, the new blocks are
    put back to their starting weights (zero init), so the model equals the original; after a resumed run,
    whose starting weights were already trained, their residual output projections are zeroed instead
    (the same function). The decision is `callback.result` and `model.config.depth_growth_fallback`.

    The rule of `hf_depthgrow.train` compares training losses (docs/theory.md §4, Condition 2); pass training rows
    as `eval_data` for that, or held-out rows to select on unseen data.

    Args:
        eval_data: Rows with `labels` in any form of the data contract (`datasets.Dataset`, list of row
            dicts, DataLoader, one batch dict), tokenised for the model.
        batch_size: Rows per forward pass for the two losses.
        data_name: What `eval_data` is, as written into the decision (`"held_out"`, `"train"`).

    Raises:
        ValueError: (at `on_train_begin`) the model is not grown, `eval_data` has no labels, or parameters
            outside the new blocks train (resetting the blocks would then not give the original back).
        NonFiniteTrainingLossError: a logged loss or gradient norm, the trained blocks or `f_new`'s loss
            is NaN/inf; the model is left as trained and nothing is selected.

    Example:
        ```python
        >>> callback = FallbackCallback(held_out, batch_size=8)
        >>> SFTTrainer(model=model, args=sft_config, train_dataset=train, processing_class=tok, callbacks=[callback]).train()
        >>> callback.result.selected, model.config.depth_growth_fallback["losses"]
        ('new', {'new': 3.91, 'old': 4.24})
        ```
    """

    def __init__(self, eval_data, *, batch_size: int = 8, data_name: str = "held_out"):
        if eval_data is None:
            raise ValueError("FallbackCallback needs eval_data: rows with labels to compare the trained and the original model on")
        check_int("batch_size", batch_size, 1)
        self.eval_data, self.batch_size, self.data_name = eval_data, batch_size, str(data_name)
        self.result: FallbackDecision | None = None
        self._rows = None
        self._initial: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = _grown_model(model)
        named = _require_grown(model, "FallbackCallback")
        new_ids = {id(p) for _, p in named}
        extra = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in new_ids]
        if extra:
            raise ValueError(
                f"FallbackCallback: {len(extra)} parameters outside the new blocks train (e.g. {extra[0]}): resetting the "
                "new blocks would not give the original model back. Call prepare_grown_model(model) before the trainer."
            )
        self._rows = training_rows(self.eval_data, "FallbackCallback eval_data", model)
        # Starting weights are the zero init only if the blocks have not trained yet (a resumed run has).
        at_zero_init = all(not p.detach().any() for p in _zero_init_params(model))
        self._initial = initial_weights(named) if at_zero_init else None

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Trainer's `logging_nan_inf_filter` hides a NaN loss from the logged mean; the gradient norm is logged raw.
        for key in ("loss", "grad_norm"):
            value = (logs or {}).get(key)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                raise NonFiniteTrainingLossError(
                    f"training diverged: the logged {key} at step {state.global_step} is {value}; nothing is selected "
                    "(lower the learning rate, or clip gradients with max_grad_norm)",
                    state.global_step,
                    logs.get("loss"),
                )

    def on_train_end(self, args, state, control, model=None, **kwargs):
        # Under bf16/fp16 the forward still autocasts: the rule compares the float32 functions that get saved.
        unwrap_autocast(model)
        model = _grown_model(model)
        named = _require_grown(model, "FallbackCallback")
        if self._rows is None:
            raise ValueError("FallbackCallback: on_train_begin did not run; add the callback before trainer.train()")
        device = next(model.parameters()).device
        acc = _Processes(device)
        bad = nonfinite_weights(named, acc)
        if bad:
            raise NonFiniteTrainingLossError(
                f"training diverged: the new blocks hold NaN/inf after step {state.global_step} ({', '.join(bad[:3])}); "
                "the model is left as trained and must not be saved", state.global_step,
            )
        self.result = self.decide(model, named, state.global_step, acc)
        setattr(model.config, FALLBACK_KEY, self.result.to_dict())

    def decide(self, model: nn.Module, named, step: int, acc) -> FallbackDecision:
        """Both losses, `pick`, and the reset when `f_old` wins (see the class docstring)."""
        rows, order = self._rows, range(len(self._rows))
        kw = dict(model=model, stone=None, peft_model=None, index=None, cache=None, accelerator=acc,
                  causal=is_causal_lm(model), batch_size=self.batch_size, progress=False)
        losses = {which: candidate_loss(which, rows, order, **kw) for which in ("new", "old")}
        if not math.isfinite(losses["new"]):
            raise NonFiniteTrainingLossError(
                f"the trained model's loss on {self.data_name} is {losses['new']} (f_old: {losses['old']}); "
                "the model is left as trained and must not be saved", step, losses["new"],
            )
        selected, _, delta = pick(losses)
        reset = None
        if selected == "old":
            if self._initial is not None:
                selected_model("old", model=model, stone=None, peft_model=None, named=named, initial=self._initial, merge_lora=False)
                reset = "starting weights"
            else:
                with torch.no_grad():
                    for param in _zero_init_params(model):
                        param.zero_()
                reset = "residual outputs zeroed"
        return FallbackDecision(selected, losses, delta, self.data_name, len(rows), int(step), reset, package_version())
