"""Training the new blocks with Accelerate: config, trainer, prefix cache, checkpoints, fallback rule."""

from .config import TrainConfig
from .trainer import GrownTrainer, TrainResult, train
