"""Training the new blocks with Accelerate: config, trainer, prefix cache, checkpoints, fallback rule.

Modules by job: `config` (TrainConfig), `trainer` (GrownTrainer, train), `result` (TrainResult),
`data_order` (rows from any data form, the seeded order), `prefix_cache`, `trainable` (trainable
sets, LoRA targets, AdamW groups), `forward` (losses on rows), `checkpoints`, `selection` (the fallback rule).
"""

from .checkpoints import list_checkpoints
from .config import TrainConfig
from .prefix_cache import PrefixCache, shares_prefix
from .result import TrainResult
from .trainable import lora_target_names
from .trainer import GrownTrainer, train

__all__ = [
    "GrownTrainer",
    "PrefixCache",
    "TrainConfig",
    "TrainResult",
    "list_checkpoints",
    "lora_target_names",
    "shares_prefix",
    "train",
]
