"""The scaling study: depth x width x data from scratch, its findings and the power-law fit."""

from .config import StudyCommand, StudyConfig, TaskGrid
from .fit import PowerLawFit, fit_power_law
from .study import run_study
from .units import CellSpec

__all__ = ["CellSpec", "PowerLawFit", "StudyCommand", "StudyConfig", "TaskGrid", "fit_power_law", "run_study"]
