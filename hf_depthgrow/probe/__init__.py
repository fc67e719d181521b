"""The probe: first-order signal of a zero-initialised block at every position, and stepping stones.

Modules: `signal` (`probe`), `result` (`ProbeResult`, verdicts), `capture` (taps on the original model
and the candidate blocks), `statistics` (streamed U-statistic, jackknife, covariance, norm regime),
`stepping_stone` (one first-order step of a new block).

Note: the top-level package binds `hf_depthgrow.probe` to the *function*; import these modules as
`from hf_depthgrow.probe.signal import probe`.
"""

from ..plots import plot_probe
from .result import VERDICT_IMPROVABLE, VERDICT_NOT_OBSERVABLE, ProbeResult
from .signal import probe
from .stepping_stone import SteppingStoneResult, stepping_stone

__all__ = [
    "VERDICT_IMPROVABLE",
    "VERDICT_NOT_OBSERVABLE",
    "ProbeResult",
    "SteppingStoneResult",
    "plot_probe",
    "probe",
    "stepping_stone",
]
