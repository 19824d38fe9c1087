"""Keras callbacks for mixed-precision training, one per module, each registered with Keras (package `"kmix"`)."""

from kmix.callbacks.learning_rate_warmup import LearningRateWarmup
from kmix.callbacks.loss_scale_monitor import LossScaleMonitor
from kmix.callbacks.loss_scale_warmup import LossScaleWarmup
from kmix.callbacks.nan_guard import NaNGuard

__all__ = ["LearningRateWarmup", "LossScaleMonitor", "LossScaleWarmup", "NaNGuard"]
