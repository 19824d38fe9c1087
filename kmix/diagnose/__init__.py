"""`kmix.diagnose`: why a float32 model would fail in half precision, before training.

`diagnose(model, x, y)` runs a few batches in float32 with a probe on every
layer, then the same batches in the policy's half dtype, and returns a
`Diagnosis`: the first non-finite layer, the layers to keep in float32, the
initial loss scale and the policy to use.
"""

from kmix.diagnose.core import diagnose
from kmix.diagnose.report import Diagnosis, LayerStats

__all__ = ["Diagnosis", "LayerStats", "diagnose"]
