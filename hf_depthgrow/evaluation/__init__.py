"""The paired test-risk evaluation: per-example losses, intervals, Route A/B terms, reports.

Modules, by job: `paired` (run both models, `evaluate_delta`, `compare_models`), `checks` (what is
checked before the first forward pass), `result` (`EvalResult`), `metrics` (accuracy, F1,
perplexity), `bounds` (the three intervals), `routes` (Route A/B arithmetic), `route_terms`
(the Route A/B inputs measured on models and data), `retention` (forgetting on a general-domain set:
`forgetting`, `evaluate_retention`), `report` (report.json / report.md / plots),
`formatting` (the one number formatter), `decisions` (certifying several arms at once with Holm or
Bonferroni, and how well a predictor's ranking matches realized gains: Spearman, partial Spearman, hit rate, regret),
`collector` (the per-example losses of each side of one pass), `plots` (the differences and intervals figures),
`lm_eval_task` (perplexity on local text through lm-evaluation-harness, offline).
"""

from ..data.batches import DataFormError
from .bounds import INTERVALS, paired_intervals
from .decisions import Correlation, corrected_intervals, partial_spearman, predictor_table, regret, spearman, top_k_hit_rate
from .metrics import classification_metrics
from .paired import compare_models, evaluate_delta, paired_losses, separate_losses
from .report import render_markdown, write_report
from .result import EvalResult, NonFiniteLossError
from .retention import evaluate_retention, forgetting
from .route_terms import block_norm_terms, route_inputs
from .routes import RouteInputs, route_bounds

__all__ = [
    "INTERVALS",
    "Correlation",
    "corrected_intervals",
    "partial_spearman",
    "predictor_table",
    "regret",
    "spearman",
    "top_k_hit_rate",
    "DataFormError",
    "EvalResult",
    "NonFiniteLossError",
    "RouteInputs",
    "block_norm_terms",
    "classification_metrics",
    "compare_models",
    "evaluate_delta",
    "evaluate_retention",
    "forgetting",
    "paired_intervals",
    "paired_losses",
    "render_markdown",
    "route_bounds",
    "route_inputs",
    "separate_losses",
    "write_report",
]
