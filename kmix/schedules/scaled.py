"""`kmix.schedules.Scaled`: another schedule multiplied by a constant factor."""

import keras
from keras import ops

from kmix import _checks as checks


@keras.saving.register_keras_serializable(package="kmix")
class Scaled(keras.optimizers.schedules.LearningRateSchedule):
    """`factor * schedule(step)`: lowers (or raises) a whole schedule at once, as `NaNGuard` does.

    Args:
        schedule: a `keras.optimizers.schedules.LearningRateSchedule`.
        factor: the multiplier, a finite float > 0.

    Returns (when called with a step):
        `factor * schedule(step)`, in the schedule's dtype.

    Example:

    >>> decay = keras.optimizers.schedules.ExponentialDecay(1e-3, 1000, 0.5)
    >>> half = kmix.schedules.Scaled(decay, 0.5)
    >>> float(half(1000))
    0.00025
    """

    def __init__(self, schedule, factor):
        if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            raise TypeError("`schedule` must be a keras.optimizers.schedules.LearningRateSchedule. "
                            f"Received: schedule={schedule!r} (of type {type(schedule).__name__}).")
        self.schedule = schedule
        self.factor = checks.real("factor", factor, low=0.0, low_open=True)

    @classmethod
    def scale(cls, schedule, factor):
        """A new `Scaled`: `schedule` times `factor`, or a `Scaled` schedule's factor multiplied (no nesting)."""
        if isinstance(schedule, Scaled):
            return cls(schedule.schedule, schedule.factor * float(factor))
        return cls(schedule, factor)

    def __call__(self, step):
        """The scaled learning rate at `step`."""
        value = ops.convert_to_tensor(self.schedule(step))
        return value * ops.cast(self.factor, value.dtype)

    def get_config(self):
        """The nested schedule (serialized) and the factor."""
        return {"schedule": keras.saving.serialize_keras_object(self.schedule), "factor": self.factor}

    @classmethod
    def from_config(cls, config):
        """Re-creates the schedule, deserializing the nested one."""
        return cls(**{**config, "schedule": keras.saving.deserialize_keras_object(config["schedule"])})

    def __repr__(self):
        return f"Scaled(schedule={self.schedule!r}, factor={self.factor})"
