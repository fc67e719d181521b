"""The probe: first-order signal of a zero-initialised block at every position, and stepping stones."""

from ..plots import plot_probe
from .signal import ProbeResult, probe
from .stepping_stone import SteppingStoneResult, stepping_stone
