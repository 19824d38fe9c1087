"""Learning-rate schedules computed in-graph: `Warmup`, `Scaled`.

Both are `keras.optimizers.schedules.LearningRateSchedule`s registered with
Keras (package `"kmix"`), so a model saved with them loads without
`custom_objects`.
"""

from kmix.schedules.scaled import Scaled
from kmix.schedules.warmup import Warmup

__all__ = ["Scaled", "Warmup"]
