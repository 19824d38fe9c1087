"""Loss-scale optimizer and `wrap`."""

from kmix.optimizers.loss_scale import LossScaleOptimizer
from kmix.optimizers.wrap import wrap

__all__ = ["LossScaleOptimizer", "wrap"]
