"""The scaling study: depth x width x data from scratch, its findings and the power-law fit."""

from .config import StudyConfig, TaskGrid
from .fit import PowerLawFit, fit_power_law
from .study import run_study

__all__ = ["PowerLawFit", "StudyConfig", "TaskGrid", "fit_power_law", "run_study"]
