"""The paired test-risk evaluation: per-example losses, intervals, Route A/B terms, reports."""

from .paired import EvalResult, compare_models, evaluate_delta, route_inputs
from .report import write_report
