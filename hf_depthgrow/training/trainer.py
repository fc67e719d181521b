"""Train grown models on Accelerate: the new blocks only, + LoRA, or everything (docs/theory.md §4).

The loop is written out (no `transformers.Trainer`) because three things need control over it:

- Frozen-prefix caching. When nothing below the lowest inserted block trains, `z = f_bot(x)` is the
  same at every step, so it is computed once per training example (up front, keyed by row; see
  `prefix_cache.py`) and each step runs only `f_top` through `prefix.start_at`.
- An exact, layout-independent loss. A step's loss is the token-weighted mean over the *global*
  batch (all processes, all accumulation micro-batches; `losses.py`), so 1 process x 4 examples and
  2 processes x 2 examples take the same optimizer step, and caching changes nothing but speed.
- The fallback rule (Condition 2; `selection.py`): at the end the training loss `L_S` of the trained
  model is compared with that of the stepping stone (or of the original model) and the better one returned.

Data in any form of `hf_depthgrow.data.batches` is read into indexable rows first; the order is a
seeded permutation per epoch indexed by a micro-batch counter (`data_order.py`), so a resumed run
(`checkpoints.py`) picks up at the same example without replaying a loader and ends at
bit-identical weights. Which weights train, and which modules run in train mode, is `trainable.py`.

At ~570 lines this module is over the package's ~400: `GrownTrainer` is one state machine (set-up,
steps, evaluation, the fallback rule, the end), and `train()` split into `begin` / `run_steps` /
`finish` / `close` (for successive halving) must see all of it; the pieces without trainer state
already live in the sibling modules.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any

import torch
from torch import nn

from ..data.batches import to_device
from ..growth.record import growth_record
from ..growth.prefix import lowest_new_index
from ..growth.quantized import bnb_mode
from ..losses import is_causal_lm
from .activation_checkpointing import activation_checkpointing
from .checkpoints import (
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    trainer_state,
)
from .config import UNGROWN_MODES, TrainConfig
from .data_order import DataOrder, fetch, input_count, selection_rows, supervised_count, training_rows
from .deepspeed_support import check_deepspeed_config, deepspeed_accelerator, engine_backward, grad_norm, numel, weights_partitioned
from .forward import batch_losses
from .guards import guard_output_dir, nonfinite_stop, run_fingerprint
from .original_losses import OriginalLosses, check_reuse, losses_key
from .prefix_cache import PrefixCache, build_caches
from .result import TrainResult, initial_result, write_outputs
from .schedules import build_scheduler
from .selection import candidate_loss, initial_weights, pick, selected_model, stone_cache, unpack_stone
from .tracking import NO_TRACKING, make_accelerator, trainer_tracking
from .trainable import layer_parameters, make_optimizer, set_train_mode, setup_trainable

STOP_EXIT_CODE = 17  # what `stop_after_step` exits with, so a test can tell it from a crash

__all__ = ["GrownTrainer", "STOP_EXIT_CODE", "train"]


class GrownTrainer:
    """Trains a model grown by `grow_depth` (see the module docstring for what it guarantees).

    Args:
        model: A grown transformers model (`growth_record(model)` is set). `trainable="full"` also takes
            an ungrown model (used to train a base model first).
        config: A `TrainConfig`.
        train_dataset: Rows of model inputs with `labels`, in any form of `hf_depthgrow.data.batches`
            (a `datasets.Dataset`, a list of row dicts, a DataLoader or iterable of batch dicts, one batch dict).
        eval_dataset: Held-out data (same forms) for evaluation every `eval_steps`.
        stepping_stone: The stepping-stone model `f~_S` for the fallback rule, or the
            `(model, SteppingStoneResult)` pair `hf_depthgrow.probe.stepping_stone` returns.
        tokenizer: Saved beside the final model.
        accelerator: An `accelerate.Accelerator` to use; by default one is made from the config.
        original_losses: An earlier run's `TrainResult.original_losses` on the same rows: reused, not recomputed.

    The model is changed in place (LoRA is injected into it, merged or removed at the end);
    `train()` returns a `TrainResult` whose `.model` is the selected model.

    Example:
        ```python
        >>> from hf_depthgrow import grow_depth
        >>> from hf_depthgrow.training import GrownTrainer, TrainConfig
        >>> grow_depth(model, [2])
        >>> result = GrownTrainer(model, TrainConfig(max_steps=50), train_ds, eval_ds).train()
        >>> result.selected, result.delta_erm
        ('new', 0.031)
        ```
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        *,
        stepping_stone=None,
        tokenizer=None,
        accelerator=None,
        original_losses=None,
    ):
        # Every input is read (and refused if unreadable or empty) before any work.
        self.train_dataset = training_rows(train_dataset, "train_data", model=model)
        self.eval_dataset = training_rows(eval_dataset, "eval_data", model=model) if eval_dataset is not None else None
        self.config = config or TrainConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.stone, self.stone_info = unpack_stone(stepping_stone)
        self._accelerator = accelerator
        self.record = growth_record(model)
        mode = self.config.trainable
        if mode not in UNGROWN_MODES and not self.record:
            raise ValueError(
                f"trainable={mode!r} trains the inserted blocks, but the model is not grown: "
                "call hf_depthgrow.grow_depth first (or use trainable='full', 'layers' or 'lora')."
            )
        if mode != "new" and bnb_mode(model) is not None:
            raise ValueError(
                f"trainable={mode!r} with a base quantised by bitsandbytes ({bnb_mode(model)}): the base's weights are frozen "
                "and quantised, and only trainable='new' (the float new blocks) is supported on it"
            )
        if mode in ("layers", "lora") and self.record:
            raise ValueError(f"trainable={mode!r} is a control that adds no depth: pass the model before grow_depth")
        if mode == "layers":
            layer_parameters(model, self.config.trainable_layers)  # out-of-range indices fail here, before any work
        if self.stone is not None and not self.record:
            raise ValueError("a stepping stone is only meaningful for a grown model")
        # Taken before LoRA is injected; identifies the run in its checkpoints (guards.py).
        self.fingerprint = run_fingerprint(model, self.train_dataset, self.config)
        cfg = self.config
        # Streamed rows are read in stream order, each once (`data.streaming`): no shuffle, no epochs.
        self.streamed = getattr(self.train_dataset, "streamed", False)
        if self.streamed and cfg.max_steps <= 0:
            raise ValueError("streamed training data needs max_steps > 0 (a stream has no epochs)")
        self.selection_rows = selection_rows(len(self.train_dataset), cfg.selection_max_examples, cfg.seed, first=self.streamed)
        self.losses_key = losses_key(self.train_dataset, self.eval_dataset, self.selection_rows if cfg.fallback else None)
        self.reuse_original_losses(original_losses)
        self._lock, self.nonfinite, self.tracking = None, None, NO_TRACKING

    list_checkpoints = staticmethod(list_checkpoints)

    def reuse_original_losses(self, losses) -> None:
        """Before `setup`: take the original's step-0 held-out loss and `L_S(f_old)` from an earlier run on the same rows."""
        needs = dict(needs_held_out=self.eval_dataset is not None, needs_train=self.config.fallback)
        self.original_losses = check_reuse(losses, self.losses_key, **needs)

    def taken_original_losses(self) -> OriginalLosses:
        """After `setup`: the original's losses this run started from, for the next run on the same rows."""
        first = self.eval_history[0] if self.eval_history and self.eval_history[0]["step"] == 0 else None
        return OriginalLosses(first["eval_loss"] if first else None, self.baseline.get("old"), self.losses_key)

    # ------------------------------------------------------------------ setup

    def setup(self) -> int:
        """Everything before the first step: accelerator, trainable set, optimizer, caches, baselines, resume.

        Returns the step to start after (0, or the resumed checkpoint's step). `train()` calls it;
        call it yourself only to drive `training_step` by hand (benchmarks).

        Example:
            ```python
            >>> trainer = GrownTrainer(grown, TrainConfig(max_steps=2), rows)
            >>> trainer.setup()
            0
            >>> trainer.training_step(1)["loss"]
            4.85
            ```
        """
        self._setup_accelerator()
        # Before any expensive step: lock output_dir, refuse another run's checkpoints.
        cfg, acc = self.config, self.accelerator
        self.resume_path = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir, is_main_process=acc.is_main_process)
        self._lock = guard_output_dir(cfg, self.resume_path, self.fingerprint, acc)
        self.tracking = trainer_tracking(self)  # report_to: Accelerate's trackers (a no-op for "none")
        self._setup_optimization()
        self._setup_caches()
        start_step = self._setup_state()
        self._set_train_mode(True)
        return start_step

    def _make_accelerator(self):
        if self._accelerator is not None:
            return self._accelerator
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":  # accelerate launch with a DeepSpeed config
            return deepspeed_accelerator(mixed_precision=self.config.mixed_precision, timeout_s=self.config.ddp_timeout)
        from .sharding import launched_fsdp_accelerator  # accelerate launch with an FSDP config: on CPU, not DDP

        sharded = launched_fsdp_accelerator(mixed_precision=self.config.mixed_precision, timeout_s=self.config.ddp_timeout)
        return sharded or make_accelerator(self.config.mixed_precision, self.config.ddp_timeout)

    def _setup_accelerator(self) -> None:
        from accelerate.utils import DistributedType, set_seed

        cfg = self.config
        self.accelerator = acc = self._make_accelerator()
        self.deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
        if self.deepspeed:  # before any work: the engine's config must agree with this config
            check_deepspeed_config(acc.state.deepspeed_plugin.deepspeed_config, cfg, model=self.model, num_processes=acc.num_processes)
        set_seed(cfg.seed)
        self.causal = is_causal_lm(self.model)
        self.unit = "tokens" if self.causal else "examples"
        self.eval_batch_size = cfg.per_device_eval_batch_size or cfg.per_device_train_batch_size
        self.prefix_index = lowest_new_index(self.model) if self.record else None
        if cfg.trainable == "layers":
            # Nothing below the lowest trained layer changes: the same frozen prefix as a new block there.
            self.prefix_index = cfg.trainable_layers[0]
        # Gradient checkpointing from the lowest layer a gradient flows through: below it nothing is kept for backward.
        self.checkpoint_from = 0 if cfg.trainable in ("full", "lora") else (self.prefix_index or 0)
        self.model.to(acc.device)
        # Checkpoints through accelerate's save_state (sharded files / the engine's checkpoint), a gathered final model.
        self.sharded = acc.distributed_type == DistributedType.FSDP or self.deepspeed
        if self.sharded and ((self.record and self.record.adapters) or cfg.trainable in ("new+lora", "lora")):
            raise NotImplementedError(
                f"under {acc.distributed_type.value} this trainer supports native blocks with trainable='new' or 'full' (adapter "
                "blocks and LoRA are saved and merged from unsharded weights); use a DDP launch config for them."
            )

    def _setup_optimization(self) -> None:
        cfg, acc = self.config, self.accelerator
        trainable = setup_trainable(self.model, cfg)
        self.trainable_named, self.train_modules, self.peft_model = trainable.named, trainable.train_modules, trainable.peft_model
        # The starting weights of the trainable set: restoring them gives back f_old as a function
        # (new blocks at zero init, LoRA B at zero), which is how the fallback returns f_old.
        self._initial = initial_weights(self.trainable_named) if cfg.fallback else None
        optimizer = make_optimizer(self.trainable_named, cfg)
        self.num_trainable = sum(numel(p) for _, p in self.trainable_named)  # ZeRO-3 empties the local tensors in prepare
        self.order = DataOrder(len(self.train_dataset), cfg.per_device_train_batch_size, acc.num_processes, cfg.seed, sequential=self.streamed)
        accum = cfg.gradient_accumulation_steps
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else max(1, math.ceil(cfg.num_train_epochs * self.order.batches_per_epoch / accum))
        if self.streamed and self.total_steps * accum > self.order.batches_per_epoch:
            raise ValueError(f"the streamed training data holds {len(self.train_dataset)} rows, fewer than {self.total_steps} steps "
                             f"x {accum * self.order.global_batch} rows per step: stream more blocks or lower max_steps")
        self.warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * self.total_steps)
        # Not passed to `prepare`: accelerate's wrapper steps a scheduler once per process.
        self.scheduler = build_scheduler(cfg.lr_scheduler, optimizer, warmup=self.warmup, total=self.total_steps, decay_ratio=cfg.decay_ratio)
        self.wrapped, self.optimizer = acc.prepare(self.model, optimizer)
        if self.sharded:
            acc.register_for_checkpointing(self.scheduler)
        # FSDP2 swaps parameters for sharded ones while preparing: look them up again.
        self.trainable_named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _set_train_mode(self, training: bool) -> None:
        set_train_mode(self.model, self.train_modules, training)

    def _setup_caches(self) -> None:
        self.train_cache, self.eval_cache, self.cache_info = build_caches(
            self.model, self.train_dataset, self.eval_dataset, self.prefix_index,
            config=self.config, accelerator=self.accelerator, eval_batch_size=self.eval_batch_size,
        )

    # ------------------------------------------------------------------ state, baselines, resume

    def _setup_state(self) -> int:
        cfg = self.config
        self.history, self.eval_history, self.baseline = [], [], {}
        self.units_seen, self._elapsed_before, self._t0 = 0, 0.0, time.perf_counter()
        self.eval_rows = list(range(len(self.eval_dataset))) if self.eval_dataset is not None else []
        if self.resume_path is not None:
            return self._load_checkpoint(self.resume_path)
        # Baselines are taken before the first step (the grown model at init *is* f_old), and
        # kept in checkpoints, so a resumed run compares against the same numbers.
        # `original_losses` (checked in __init__: the same rows) saves both passes over the original.
        reuse = self.original_losses
        if self.eval_dataset is not None:
            loss = reuse.held_out if reuse else self._dataset_loss(self.eval_dataset, self.eval_rows, cache=self.eval_cache, desc="held-out loss (f_old)")
            self.eval_history.append({"step": 0, "eval_loss": loss})
            self.tracking.log_eval(0, loss)
        if cfg.fallback:
            self.baseline["old"] = reuse.train if reuse else self._dataset_loss(
                self.train_dataset, self.selection_rows, which="old", cache=self.train_cache, desc="train loss (f_old)"
            )
            if self.stone is not None:
                self.stone.to(self.accelerator.device)
                self.baseline["stepping_stone"] = self._dataset_loss(
                    self.train_dataset, self.selection_rows, which="stone", cache=self._stone_cache(self.train_cache), desc="train loss (stepping stone)"
                )
        return 0

    def _stone_cache(self, cache: PrefixCache | None) -> PrefixCache | None:
        return stone_cache(cache, self.model, self.stone, self.prefix_index)

    def _dataset_loss(self, dataset, rows, *, which: str = "new", cache: PrefixCache | None = None, desc: str = "loss") -> float:
        return candidate_loss(
            which, dataset, rows, model=self.model, stone=self.stone, peft_model=self.peft_model, index=self.prefix_index,
            cache=cache, accelerator=self.accelerator, causal=self.causal, batch_size=self.eval_batch_size,
            progress=self.config.progress_bar, desc=desc, chunk_size=self.config.loss_chunk,
        )

    def _save_checkpoint(self, step: int):
        return save_checkpoint(
            self.accelerator, self.config.output_dir, step, sharded=self.sharded, named=self.trainable_named,
            optimizer=self.optimizer, scheduler=self.scheduler, trainer_state=trainer_state(self, step),
            save_total_limit=self.config.save_total_limit,
        )

    def _load_checkpoint(self, path) -> int:
        state = load_checkpoint(
            path, self.accelerator, global_batch=self.order.global_batch, sharded=self.sharded,
            named=self.trainable_named, optimizer=self.optimizer, scheduler=self.scheduler,
        )
        self.history, self.eval_history = state["history"], state["eval_history"]
        self.baseline = state["baseline"]
        self.units_seen = state["units_seen"]
        self._elapsed_before = state["elapsed"]
        return int(state["global_step"])

    def _elapsed(self) -> float:
        return self._elapsed_before + (time.perf_counter() - self._t0)

    # ------------------------------------------------------------------ training

    def training_step(self, step: int) -> dict:
        """One optimizer step (1-based `step`): its micro-batches, backward, clip, AdamW, scheduler.

        Returns `{"loss", "units", "seconds", "grad_norm"}`; `loss` is the global token-weighted
        (causal LM) or per-example (classifier) mean of the step's batch.
        """
        cfg, acc = self.config, self.accelerator
        world, rank, accum = acc.num_processes, acc.process_index, cfg.gradient_accumulation_steps
        t_step = time.perf_counter()
        rows = [self.order.local_indices(p, rank) for p in range((step - 1) * accum, step * accum)]
        batches = [to_device(fetch(self.train_dataset, r), acc.device) for r in rows]
        counts = torch.tensor(
            [sum(supervised_count(b, self.causal) for b in batches), sum(input_count(b, self.causal) for b in batches)],
            dtype=torch.float64,
            device=acc.device,
        )
        counts = acc.reduce(counts, reduction="sum") if world > 1 else counts
        weight = counts[0].clamp_min(1)
        loss_sum = torch.zeros((), dtype=torch.float64, device=acc.device)
        for i, (r, batch) in enumerate(zip(rows, batches)):
            # Gradients are all-reduced once per optimizer step, on the last micro-batch.
            sync = contextlib.nullcontext() if i == accum - 1 else acc.no_sync(self.wrapped)
            with sync, activation_checkpointing(self.model, self.checkpoint_from, enabled=cfg.gradient_checkpointing):
                el = batch_losses(self.wrapped, self.model, batch, r, self.train_cache, self.prefix_index, accelerator=acc, causal=self.causal,
                                  chunk_size=self.config.loss_chunk)
                total = el.total.sum()
                # Sum of token losses over the global weight, times the process count because
                # DDP (and DeepSpeed) average gradients over processes: the gradient of the global mean.
                loss = total / weight.to(total.dtype) * world
                if self.deepspeed:
                    engine_backward(acc, loss, boundary=i == accum - 1)  # steps (and clips) on the last micro-batch
                else:
                    acc.backward(loss)
            loss_sum += total.detach().double()
        norm = None
        if cfg.max_grad_norm:
            norm = grad_norm(acc) if self.deepspeed else float(acc.clip_grad_norm_([p for _, p in self.trainable_named], cfg.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = acc.reduce(loss_sum, reduction="sum") if world > 1 else loss_sum
        self.units_seen += int(counts[1])
        return {"loss": float(loss_sum / weight), "units": int(counts[1]), "seconds": time.perf_counter() - t_step, "grad_norm": norm}

    def train(self) -> TrainResult:
        """Run the training; returns a `TrainResult` with the selected model. The output_dir lock is released on any exit."""
        try:
            return self._train()
        finally:
            self.tracking.finish()  # also when a step fails: the run's files are closed
            if self._lock is not None:
                self._lock.release()

    def _train(self) -> TrainResult:
        self.begin()
        self.run_steps(self.total_steps)
        return self.finish()

    # `begin` / `run_steps` / `finish` are `train()` in three parts, so a caller can interleave several
    # runs (successive halving over a learning-rate grid in `hf_depthgrow.comparison`).

    def begin(self) -> int:
        """Set up (see `setup`) and open the progress bar; returns the step training continues after."""
        from tqdm.auto import tqdm

        self._step = self.setup()
        show = self.config.progress_bar and self.accelerator.is_main_process
        self._bar = tqdm(total=self.total_steps, initial=self._step, desc="train", unit="step", disable=not show)
        self._window, self.stopped = [0, 0.0], False
        return self._step

    def run_steps(self, until: int) -> int:
        """Train up to step `until` (at most `total_steps`), unless a non-finite loss stops the run; returns the last step."""
        cfg, acc, bar = self.config, self.accelerator, self._bar
        for step in range(self._step + 1, min(until, self.total_steps) + 1):
            if self.stopped:
                break
            out = self.training_step(step)
            self._step = step
            if self._stop_nonfinite(step, out):
                self.stopped = True
                break
            self._window[0] += out["units"]
            self._window[1] += out["seconds"]
            rate = self._window[0] / max(self._window[1], 1e-9)
            if step % cfg.logging_steps == 0 or step == self.total_steps:
                self._log_step(step, out, rate)
                self._window = [0, 0.0]
            bar.set_postfix({"loss": f"{out['loss']:.4f}", f"{'tok' if self.causal else 'ex'}/s": f"{rate:.0f}"}, refresh=False)
            bar.update(1)
            if self.eval_dataset is not None and cfg.eval_steps and step % cfg.eval_steps == 0 and step != self.total_steps:
                self._evaluate_during(step, bar)
            if cfg.save_steps and step % cfg.save_steps == 0:
                if self._stop_nonfinite(step):  # never write a non-finite checkpoint
                    self.stopped = True
                    break
                self._save_checkpoint(step)
            if cfg.stop_after_step is not None and step == cfg.stop_after_step:
                bar.close()
                acc.wait_for_everyone()
                os._exit(STOP_EXIT_CODE)  # a crash, as far as the run is concerned: no cleanup, no final save
        return self._step

    def heldout_loss(self) -> float:
        """Held-out loss of the model as it is now (needs eval data); training mode is restored afterwards."""
        if self.eval_dataset is None:
            raise ValueError("heldout_loss needs eval data")
        self._set_train_mode(False)
        loss = self._dataset_loss(self.eval_dataset, self.eval_rows, cache=self.eval_cache, desc=f"held-out loss (step {self._step})")
        self._set_train_mode(True)
        self.tracking.log_eval(self._step, loss)
        return loss

    def selection_loss(self) -> float:
        """`L_S` of the model as it is now, on the fallback rule's training rows; training mode is restored afterwards."""
        self._set_train_mode(False)
        loss = self._dataset_loss(self.train_dataset, self.selection_rows, which="new", cache=self.train_cache, desc=f"train loss (step {self._step})")
        self._set_train_mode(True)
        return loss

    def close(self) -> None:
        """Drop a run started with `begin`: nothing is selected, evaluated or saved; caches and the output_dir lock go.

        Safe at any point, also when `begin` failed half-way (a missing checkpoint, Ctrl-C while the prefix cache is
        built): only what was set up is closed, so the error that stopped the set-up is the one the caller sees.
        """
        bar = getattr(self, "_bar", None)
        if bar is not None:
            bar.close()
        self.tracking.finish()
        for name in ("train_cache", "eval_cache"):
            cache = getattr(self, name, None)
            if cache is not None:
                cache.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def finish(self) -> TrainResult:
        """After the last step: final checks, the fallback rule, the final evaluation and outputs (the end of `train()`)."""
        self._bar.close()
        if self.nonfinite is None:
            self._stop_nonfinite(self._step)  # the last update's weights, before anything is selected or saved
        self._set_train_mode(False)
        try:
            return self._finish(self._step)
        finally:
            self.tracking.finish()
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _stop_nonfinite(self, step: int, out: dict | None = None) -> bool:
        """Check a step's loss (`out`) or the trainable weights (`out=None`); `True`: stop (see `guards.nonfinite_stop`)."""
        self.nonfinite = nonfinite_stop(step, out, named=self.trainable_named, accelerator=self.accelerator,
                                        sharded=self.sharded, fallback=self.config.fallback)
        return self.nonfinite is not None

    def _log_step(self, step: int, out: dict, rate: float) -> None:
        entry = {"step": step, "loss": out["loss"], "lr": self.scheduler.get_last_lr()[0], f"{self.unit}_per_s": rate,
                 "step_seconds": out["seconds"]}
        if out["grad_norm"] is not None:
            entry["grad_norm"] = out["grad_norm"]
        self.history.append(entry)
        self.tracking.log_train(entry, self.unit)

    def _evaluate_during(self, step: int, bar) -> None:
        self._set_train_mode(False)
        loss = self._dataset_loss(self.eval_dataset, self.eval_rows, cache=self.eval_cache, desc=f"held-out loss (step {step})")
        self.eval_history.append({"step": step, "eval_loss": loss})
        self.tracking.log_eval(step, loss)
        if self.accelerator.is_main_process and self.config.progress_bar:
            bar.write(f"step {step}: eval loss {loss:.4f}")
        self._set_train_mode(True)

    # ------------------------------------------------------------------ the end: fallback rule, save

    def _finish(self, total_steps: int) -> TrainResult:
        result = initial_result(self, total_steps)
        result.num_trainable_parameters = self.num_trainable
        if self.eval_history and self.eval_history[0]["step"] == 0:
            result.eval_loss_before = self.eval_history[0]["eval_loss"]
        result.original_losses = self.taken_original_losses()
        if self.eval_dataset is not None:
            result.eval_loss_after = self._dataset_loss(self.eval_dataset, self.eval_rows, cache=self.eval_cache, desc="held-out loss (f_new)")
            self.eval_history.append({"step": total_steps, "eval_loss": result.eval_loss_after})
            result.eval_loss_selected = result.eval_loss_after
        self._select(result)
        self.tracking.log_result(result, total_steps)
        result.train_runtime = self._elapsed()
        for cache in (self.train_cache, self.eval_cache):
            if cache is not None:
                cache.close()
        self._save_outputs(result)
        return result

    def _select(self, result: TrainResult) -> None:
        """Apply the fallback rule: fill `train_losses`, `reference`, `delta_erm`, `selected` and `model`."""
        if self.config.fallback:
            new = self._dataset_loss(self.train_dataset, self.selection_rows, which="new", cache=self.train_cache, desc="train loss (f_new)")
            result.train_losses = {"new": new, **self.baseline}
            result.selected, result.reference, result.delta_erm = pick(result.train_losses, exclude=("new",) if self.nonfinite else ())
        result.model = selected_model(
            result.selected, model=self.model, stone=self.stone, peft_model=self.peft_model,
            named=self.trainable_named, initial=self._initial, merge_lora=self.config.merge_lora,
        )
        if result.selected == "old":
            result.eval_loss_selected = result.eval_loss_before
        elif result.selected == "stepping_stone" and self.eval_dataset is not None:
            result.eval_loss_selected = self._dataset_loss(
                self.eval_dataset, self.eval_rows, which="stone", cache=self._stone_cache(self.eval_cache), desc="held-out loss (stepping stone)"
            )

    def _save_outputs(self, result: TrainResult) -> None:
        cfg, acc = self.config, self.accelerator
        full_state = None
        if weights_partitioned(acc) and cfg.output_dir and cfg.save_final_model and result.model is self.model:
            full_state = acc.get_state_dict(self.wrapped)  # collective: gathers the shards on the main process
        if cfg.output_dir and acc.is_main_process:
            write_outputs(result, cfg, tokenizer=self.tokenizer, peft_model=self.peft_model, full_state=full_state)
        acc.wait_for_everyone()


def train(
    model: nn.Module,
    train_data,
    *,
    config: TrainConfig | None = None,
    eval_data=None,
    stepping_stone=None,
    tokenizer=None,
    accelerator=None,
    original_losses=None,
    **kwargs: Any,
) -> TrainResult:
    """Train a grown model and apply the fallback rule; the functional face of `GrownTrainer`.

    Args:
        model: A model grown with `grow_depth` (changed in place).
        train_data: Training data (inputs + `labels`) in any form of `hf_depthgrow.data.batches`: a
            `datasets.Dataset` (e.g. from `hf_depthgrow.data.sources.load_data`), a list of row dicts,
            a DataLoader or iterable of batch dicts, or one batch dict. The fallback rule's `L_S` is
            taken on these rows too.
        config: A `TrainConfig`; or pass its fields as keyword arguments.
        eval_data: Held-out data (same forms), evaluated before, every `eval_steps`, and after.
        stepping_stone: `f~_S` (a model or `stepping_stone(...)`'s `(model, result)`) for the fallback rule;
            without it the trained model is compared with the original (`bypass_new_blocks`).
        tokenizer: Saved beside the final model.
        accelerator: An existing `Accelerator` (default: one built from the config).
        original_losses: An earlier run's `TrainResult.original_losses` on the same data: its step-0 held-out
            loss and `L_S(f_old)` are reused instead of recomputed (every run starts from the original
            function). Refused (`ValueError`) if taken on other rows.

    Returns:
        `TrainResult`: `.model` (selected), `.selected`, `.train_losses`, `.delta_erm`, histories.

    Raises:
        `hf_depthgrow.data.batches.DataFormError` for data in no accepted form; `ValueError` for empty
        data, rows without `labels`, or a bad configuration. From `training.guards`: `CheckpointMismatchError`,
        `OutputDirLockedError` (before any work) and `NonFiniteTrainingLossError` (a diverged run, fallback off).

    Example:
        ```python
        >>> from hf_depthgrow import grow_depth
        >>> from hf_depthgrow.training import train
        >>> from hf_depthgrow.testing import tiny_model
        >>> model = grow_depth(tiny_model("llama"), [2])
        >>> result = train(model, train_ds, eval_data=eval_ds, max_steps=20, learning_rate=1e-3)
        >>> result.selected in ("new", "old")
        True
        ```
    """
    if config is not None and kwargs:
        raise ValueError(f"pass either config= or keyword arguments, not both (got {sorted(kwargs)})")
    config = config or TrainConfig(**kwargs)
    trainer = GrownTrainer(model, config, train_data, eval_data, stepping_stone=stepping_stone, tokenizer=tokenizer,
                           accelerator=accelerator, original_losses=original_losses)
    return trainer.train()
