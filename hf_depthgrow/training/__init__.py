"""Training the new blocks with Accelerate: config, trainer, prefix cache, checkpoints, fallback rule.

Modules by job: `config` (TrainConfig), `trainer` (GrownTrainer, train), `result` (TrainResult),
`data_order` (rows from any data form, the seeded order), `prefix_cache`, `trainable` (trainable
sets, LoRA targets, AdamW groups), `forward` (losses on rows), `checkpoints`, `selection` (the fallback rule),
`guards` (run fingerprints, the output_dir lock, non-finite losses), `cache_plan` (whether
`prefix_cache="auto"` pays), `tracking` (accelerate trackers), `hf_integration` (transformers'
`Trainer` and trl's `SFTTrainer` on a grown model: `prepare_grown_model`, `FallbackCallback`),
`activation_checkpointing` (gradient checkpointing above the frozen prefix), `memory_plan` (what an arm
needs per device, from a config on the meta device: `plan_memory`), `original_losses` (the original's losses,
taken once and handed on), `schedules` (learning-rate schedules, warmup-stable-decay), `branching` (a decay branched
off a running warmup-stable-decay run), `sharding` (FSDP2), `deepspeed_support` (DeepSpeed ZeRO-2 / ZeRO-3).
"""

from .checkpoints import list_checkpoints
from .config import TrainConfig
from .activation_checkpointing import activation_checkpointing
from .checkpoints import CheckpointIntegrityError, CheckpointMismatchError
from .guards import NonFiniteTrainingLossError, OutputDirLockedError
from .memory_plan import MemoryPlan, PlanSettings, plan_memory
from .original_losses import OriginalLosses
from .prefix_cache import PrefixCache, shares_prefix
from .result import TrainResult
from .trainable import lora_target_names
from .trainer import GrownTrainer, train

__all__ = [
    "CheckpointIntegrityError",
    "MemoryPlan",
    "PlanSettings",
    "activation_checkpointing",
    "plan_memory",
    "CheckpointMismatchError",
    "FallbackCallback",
    "FallbackDecision",
    "keep_growth_on_save",
    "prepare_grown_model",
    "write_growth_files",
    "NonFiniteTrainingLossError",
    "OutputDirLockedError",
    "OriginalLosses",
    "GrownTrainer",
    "PrefixCache",
    "TrainConfig",
    "TrainResult",
    "list_checkpoints",
    "lora_target_names",
    "shares_prefix",
    "train",
]

# transformers' Trainer callbacks pull in peft and bitsandbytes (seconds): loaded on first use, so that what only
# reads results (`compare --gather`, the reports) does not pay for them.
_HF_INTEGRATION = ("FallbackCallback", "FallbackDecision", "keep_growth_on_save", "prepare_grown_model", "write_growth_files")


def __getattr__(name):
    if name in _HF_INTEGRATION:
        from . import hf_integration

        return getattr(hf_integration, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
