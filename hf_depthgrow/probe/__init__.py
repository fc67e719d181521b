"""The probe: first-order signal of a zero-initialised block at every position, and stepping stones.

Modules: `signal` (`probe`), `result` (`ProbeResult`, verdicts), `capture` (taps on the original model
and the candidate blocks), `statistics` (streamed U-statistic, jackknife, covariance, norm regime),
`stepping_stone` (one first-order step of a new block; `stepping_stones`: `f~_S` and `f~_pop` from one set-up), `baselines` (cheap predictors to hold the probe
against: layer gradient norms, block influence, depth; `predictor_scores` runs any set of them with its
cost), `lookahead` (a few training steps of the new block at each position; the one-step first-order check), `plots`
(the probe's figure), `line_search` (the stepping stones' step-size search), `placement_rules` (two placement
rules from the literature, ADEPT and MIDAS, as predictors), `placement_policy` (every placement policy's regret on
the committed oracle tasks, and the default: the smallest worst case).

Note: the top-level package binds `hf_depthgrow.probe` to the *function*; import these modules as
`from hf_depthgrow.probe.signal import probe`.
"""

from .baselines import PREDICTORS, block_influence, layer_gradient_norms, predictor_scores
from .lookahead import lookahead_scores, one_step_check
from .plots import plot_probe, probe_figure
from .result import VERDICT_IMPROVABLE, VERDICT_NOT_OBSERVABLE, ProbeResult
from .signal import probe
from .stepping_stone import SteppingStoneResult, stepping_stone, stepping_stones

__all__ = [
    "PREDICTORS",
    "VERDICT_IMPROVABLE",
    "VERDICT_NOT_OBSERVABLE",
    "ProbeResult",
    "SteppingStoneResult",
    "block_influence",
    "layer_gradient_norms",
    "lookahead_scores",
    "one_step_check",
    "plot_probe",
    "predictor_scores",
    "probe",
    "probe_figure",
    "stepping_stone",
    "stepping_stones",
]
