"""Evidence that decides: growth plans against equal-budget controls, paired, corrected across arms.

Modules by job: `arms` (growth placements and the controls matched to them), `config` (CompareConfig),
`grids` (each arm kind's learning-rate grid and its extension), `trial` (the trial unit: one arm at one
rate, scored at every budget), `engine` (where trials run), `store` (stored, verified trials: resume),
`aggregate` (trials to a CompareResult), `frontier` (gain x forgetting), `crossover` (learning-curve fits),
`fresh_data` (the training blocks the budgets need: refused or warned where they would repeat, epochs per budget),
`runner` (`compare_plans`), `result` and `sweep_report` (CompareResult: tables, verdicts, JSON/Markdown/plots),
`plots` (the sweep's figures), `validation` (the probe against an oracle sweep).
"""

from .aggregate import aggregate
from .arms import CONTROL_KINDS, Arm, build_arms, lora_rank_for, matched_layers, resolve_growth
from .config import CompareConfig
from .crossover import fit_learning_curve, predict_crossover, validate_fit
from .result import ArmResult, BudgetView, CompareResult
from .runner import compare_plans, example_losses
from .trial import BudgetScore, TrialInputs, TrialResult, TrialSpec, run_trial
from .validation import ProbeValidation, validate_probe

__all__ = [
    "CONTROL_KINDS",
    "Arm",
    "ArmResult",
    "BudgetScore",
    "BudgetView",
    "CompareConfig",
    "CompareResult",
    "ProbeValidation",
    "TrialInputs",
    "TrialResult",
    "TrialSpec",
    "aggregate",
    "build_arms",
    "compare_plans",
    "example_losses",
    "fit_learning_curve",
    "lora_rank_for",
    "matched_layers",
    "predict_crossover",
    "resolve_growth",
    "run_trial",
    "validate_fit",
    "validate_probe",
]
