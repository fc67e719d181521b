"""Evidence that decides: growth plans against equal-budget controls, paired, corrected across arms."""

from .aggregate import aggregate
from .arms import CONTROL_KINDS, Arm, build_arms, lora_rank_for, matched_layers, resolve_growth
from .config import CompareConfig
from .crossover import fit_learning_curve, predict_crossover, validate_fit
from .result import ArmResult, BudgetView, CompareResult
from .runner import compare_plans
from .trial import BudgetScore, TrialInputs, TrialResult, TrialSpec, example_losses, run_trial
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
