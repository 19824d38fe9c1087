"""Loss-scale optimizer, `wrap`, and an SGD whose momentum survives float16 storage."""

from kmix.optimizers.loss_scale import LossScaleOptimizer
from kmix.optimizers.updates import SGD
from kmix.optimizers.wrap import wrap

__all__ = ["LossScaleOptimizer", "SGD", "wrap"]
