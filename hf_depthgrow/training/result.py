"""`TrainResult`: what `train` returns, and writing it out (the final model, config and result JSON)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from ..utils import atomic_write_text

FINAL_MODEL = "model"
FINAL_BLOCKS = "blocks"  # beside `model`, for a quantised base: the new blocks alone, to load onto that base again


@dataclass
class TrainResult:
    """What `train` returns; `to_dict()` is what `<output_dir>/train_result.json` holds.

    Attributes:
        model: The selected model (unwrapped, on the training device): the trained one, the stepping
            stone, or the original function (see `selected`).
        selected: `"new"`, `"stepping_stone"` or `"old"`. With `fallback=False` always `"new"`.
        train_losses: Training loss `L_S` of each candidate on the same examples
            (`"new"`, `"old"`, and `"stepping_stone"` when one was given).
        reference: The model `Delta_ERM` is measured against: `"stepping_stone"` if given, else `"old"`.
        delta_erm: `L_S(reference) - L_S(f_new)`; `>= 0` whenever `f_new` is selected.
        global_step: Optimizer steps done.
        history: One dict per logged step (`step`, `loss`, `lr`, `grad_norm`, `tokens_per_s` or `examples_per_s`).
        eval_history: `{"step", "eval_loss"}` on the held-out split (step 0 is before training).
        eval_loss_selected: Held-out loss of the selected model.
        num_train_examples: Size `n` of the training set; `num_selection_examples` of the rows `L_S` is taken on.
        prefix_cache: Mode, dtype, index, size and build time of the cache, or `None` if off.
        prefix_cache_choice: Whether the cache was built and why (with `"auto"`: the predicted prefix work
            with and without it, see `hf_depthgrow.training.cache_plan`).
        original_losses: The original's step-0 held-out loss and `L_S(f_old)` with the rows they were taken on
            (`OriginalLosses`): pass them to the next run on the same data (`train(..., original_losses=...)`).
        nonfinite: `{"step", "loss"}` where a run with the fallback rule on stopped on a non-finite
            loss (`f_new` is then never selected), else `None`.

    Example:
        ```python
        >>> result = train(grown, rows, max_steps=10)
        >>> sorted(result.to_dict())[:3]
        ['delta_erm', 'eval_history', 'eval_loss_after']
        ```
    """

    model: nn.Module
    selected: str = "new"
    train_losses: dict[str, float] = field(default_factory=dict)
    reference: str | None = None
    delta_erm: float | None = None
    global_step: int = 0
    history: list[dict] = field(default_factory=list)
    eval_history: list[dict] = field(default_factory=list)
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    eval_loss_selected: float | None = None
    train_runtime: float = 0.0
    units_seen: int = 0
    unit: str = "tokens"
    num_trainable_parameters: int = 0
    trainable: str = "new"
    num_train_examples: int = 0
    num_selection_examples: int = 0
    num_processes: int = 1
    prefix_cache: dict | None = None
    prefix_cache_choice: str | None = None
    stepping_stone: dict | None = None
    resumed_from: str | None = None
    nonfinite: dict | None = None
    model_path: str | None = None
    blocks_path: str | None = None
    original_losses: object = None  # OriginalLosses

    def to_dict(self) -> dict:
        """Every field but the model, deep-copied (JSON-ready apart from numbers' types)."""
        # Not `asdict`: it would deep-copy the model.
        data = {key: copy.deepcopy(getattr(self, key)) for key in self.__dataclass_fields__ if key != "model"}
        if self.original_losses is not None:
            data["original_losses"] = self.original_losses.to_dict()
        return data


def initial_result(trainer, global_step: int) -> TrainResult:
    """A `GrownTrainer`'s `TrainResult` at the end of training, before the fallback rule and the final evaluation."""
    cfg = trainer.config
    return TrainResult(
        model=trainer.model,
        global_step=global_step,
        history=trainer.history,
        eval_history=trainer.eval_history,
        unit=trainer.unit,
        units_seen=trainer.units_seen,
        num_trainable_parameters=sum(p.numel() for _, p in trainer.trainable_named),
        trainable=cfg.trainable,
        num_processes=trainer.accelerator.num_processes,
        num_train_examples=len(trainer.train_dataset),
        num_selection_examples=len(trainer.selection_rows) if cfg.fallback else 0,
        prefix_cache=info if (info := trainer.cache_info) and info["mode"] != "off" else None,
        prefix_cache_choice=info["choice"] if info else None,
        stepping_stone=trainer.stone_info,
        resumed_from=str(trainer.resume_path) if trainer.resume_path else None,
        nonfinite=trainer.nonfinite,
    )


def save_quantized_blocks(model: nn.Module, path) -> str | None:
    """For a model grown on a bitsandbytes-quantised base, save its new blocks alone at `path` (`blocks_only=True`,
    the base named by the folder or Hub id it was loaded from); returns the path, or `None` for any other model.

    Example:
        ```python
        >>> save_quantized_blocks(grown_4bit, "out/blocks")
        'out/blocks'
        ```
    """
    from ..growth.quantized import bnb_mode
    from ..growth.record import growth_record
    from ..hub.serialization import save_pretrained

    if bnb_mode(model) is None or growth_record(model) is None:
        return None
    save_pretrained(model, path, blocks_only=True, base_model=model.config.name_or_path)
    return str(path)


def write_outputs(result: TrainResult, config, *, tokenizer=None, peft_model=None, full_state: dict | None = None) -> None:
    """Write `<output_dir>/model` (if `save_final_model`), `train_config.json` and `train_result.json`.

    A model still wrapped by PEFT is saved from a merged copy (the caller's model stays as it is);
    `full_state` is the gathered state dict of an FSDP-sharded model. Sets `result.model_path`.

    Example:
        ```python
        >>> write_outputs(result, TrainConfig(output_dir="out"))
        >>> sorted(p.name for p in Path("out").iterdir())
        ['model', 'train_config.json', 'train_result.json']
        ```
    """
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config.save_final_model:
        from ..hub.serialization import save_pretrained

        to_save = result.model
        if peft_model is not None and result.model is peft_model:
            to_save = copy.deepcopy(peft_model).merge_and_unload()
        extra = {"state_dict": full_state} if full_state is not None else {}
        save_pretrained(to_save, out / FINAL_MODEL, tokenizer=tokenizer, **extra)  # a quantised base: merged, dequantised
        result.model_path = str(out / FINAL_MODEL)
        result.blocks_path = save_quantized_blocks(to_save, out / FINAL_BLOCKS)
    atomic_write_text(out / "train_config.json", config.to_json_string())
    atomic_write_text(out / "train_result.json", json.dumps(result.to_dict(), indent=2, sort_keys=True, default=str))
