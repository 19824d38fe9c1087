"""Keras callbacks for mixed-precision training, one per module.

- `LearningRateWarmup`: installs a `kmix.schedules.Warmup` on the optimizer.
- `LossScaleWarmup`: starts the loss scale low and grows it fast until it overflows.
- `LossScaleMonitor`: `loss_scale`, `skipped_steps`, `overflow_rate` in the logs;
  an overflow report at the end of training.
- `NaNGuard`: rolls back to the last good weights on a non-finite loss.

Each has `get_config` / `from_config` and is registered with Keras (package `"kmix"`).
"""

from kmix.callbacks.learning_rate_warmup import LearningRateWarmup
from kmix.callbacks.loss_scale_monitor import LossScaleMonitor
from kmix.callbacks.loss_scale_warmup import LossScaleWarmup
from kmix.callbacks.nan_guard import NaNGuard

__all__ = ["LearningRateWarmup", "LossScaleMonitor", "LossScaleWarmup", "NaNGuard"]
