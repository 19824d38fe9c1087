"""Learning-rate schedules computed in-graph, registered with Keras (package `"kmix"`): `Warmup`, `Scaled`."""

from kmix.schedules.scaled import Scaled
from kmix.schedules.warmup import Warmup

__all__ = ["Scaled", "Warmup"]
