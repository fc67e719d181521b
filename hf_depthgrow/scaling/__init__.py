"""The scaling study: depth x width x data from scratch, its findings and the power-law fit."""

from .fit import PowerLawFit, fit_power_law
from .study import StudyConfig, TaskGrid, run_study
