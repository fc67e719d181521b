"""Evidence that decides: growth plans against equal-budget controls, paired, corrected across arms.

Modules by job: `arms` (growth placements and the controls matched to them), `config` (CompareConfig),
`runner` (`compare_plans`: train every arm at one budget, score them on the same examples), `result`
(CompareResult: table, verdict, JSON/Markdown/plot).
"""

from .arms import CONTROL_KINDS, Arm, build_arms, lora_rank_for, matched_layers, resolve_growth
from .config import CompareConfig
from .result import ArmResult, CompareResult
from .runner import compare_plans, example_losses

__all__ = [
    "CONTROL_KINDS",
    "Arm",
    "ArmResult",
    "CompareConfig",
    "CompareResult",
    "build_arms",
    "compare_plans",
    "example_losses",
    "lora_rank_for",
    "matched_layers",
    "resolve_growth",
]
