"""`kmix.diagnose`: why a float32 model would fail in half precision, before training."""

from kmix.diagnose.core import diagnose
from kmix.diagnose.report import Diagnosis, LayerStats

__all__ = ["Diagnosis", "LayerStats", "diagnose"]
