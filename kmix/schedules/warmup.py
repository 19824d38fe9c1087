"""`kmix.schedules.Warmup`: a learning-rate warm-up computed in-graph."""

import math
import numbers

import keras
from keras import ops

from kmix import _checks as checks

SHAPES = ("linear", "exponential", "cosine")


@keras.saving.register_keras_serializable(package="kmix")
class Warmup(keras.optimizers.schedules.LearningRateSchedule):
    """Ramps the learning rate from `initial * base(step)` up to `base(step)`.

    With `t = min(step / warmup_steps, 1)` the rate is `base(step) * f(t)`:

    ```
    linear:       f(t) = initial + (1 - initial) * t
    exponential:  f(t) = initial ** (1 - t)            # geometric, needs initial > 0
    cosine:       f(t) = initial + (1 - initial) * (1 - cos(pi * t)) / 2
    step >= warmup_steps:  rate = base(step)           # exactly, not base * f(1)
    ```

    `step` is the optimizer's `iterations` (a step a loss-scale optimizer skips does not advance it),
    and the rate is computed in the graph from it.

    Args:
        base: the rate after warm-up: a float >= 0 or a `LearningRateSchedule` (which keeps running).
        warmup_steps: how many steps the warm-up lasts, an int >= 0 (0: none).
        initial: the fraction of `base(step)` it starts from, in [0, 1]; in (0, 1] for `"exponential"`.
        shape: `"linear"`, `"exponential"` or `"cosine"`.

    Returns (when called with a step):
        The learning rate, a float32 scalar tensor.

    Example:

    >>> decay = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=10_000)
    >>> lr = kmix.schedules.Warmup(decay, warmup_steps=500, initial=0.01)
    >>> float(lr(0)), float(lr(250)), float(lr(500)) == float(decay(500))
    (1e-05, 0.000504..., True)
    >>> opt = kmix.wrap(keras.optimizers.AdamW(learning_rate=lr))
    """

    def __init__(self, base, warmup_steps, initial=0.0, shape="linear"):
        self.base = _check_base(base)
        self.warmup_steps = checks.integer("warmup_steps", warmup_steps, minimum=0)
        self.initial = _check_initial(initial, shape)
        self.shape = shape

    def __call__(self, step):
        """The learning rate at `step` (an int or an integer scalar tensor)."""
        if isinstance(self.base, keras.optimizers.schedules.LearningRateSchedule):
            base = ops.convert_to_tensor(self.base(step))
        else:
            base = ops.convert_to_tensor(self.base, "float32")
        if self.warmup_steps == 0:
            return base
        dtype = base.dtype
        step = ops.cast(step, dtype)
        t = ops.minimum(step / ops.cast(self.warmup_steps, dtype), 1.0)
        initial = ops.cast(self.initial, dtype)
        if self.shape == "linear":
            factor = initial + (1.0 - initial) * t
        elif self.shape == "exponential":
            factor = ops.power(initial, 1.0 - t)
        else:
            factor = initial + (1.0 - initial) * 0.5 * (1.0 - ops.cos(math.pi * t))
        return ops.where(step >= self.warmup_steps, base, base * factor)

    def get_config(self):
        """Every constructor argument; a schedule `base` is serialized with it."""
        base = self.base
        if isinstance(base, keras.optimizers.schedules.LearningRateSchedule):
            base = keras.saving.serialize_keras_object(base)
        return {"base": base, "warmup_steps": self.warmup_steps, "initial": self.initial, "shape": self.shape}

    @classmethod
    def from_config(cls, config):
        """Re-creates the schedule, deserializing a nested `base` schedule."""
        config = dict(config)
        if isinstance(config["base"], dict):
            config["base"] = keras.saving.deserialize_keras_object(config["base"])
        return cls(**config)

    def __repr__(self):
        return (f"Warmup(base={self.base!r}, warmup_steps={self.warmup_steps}, initial={self.initial}, "
                f"shape={self.shape!r})")


def _check_base(base, name="base"):
    """`base` as a float >= 0, or the schedule it is; raises naming `name` otherwise."""
    if isinstance(base, keras.optimizers.schedules.LearningRateSchedule):
        return base
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"`{name}` must be a float >= 0 or a keras.optimizers.schedules.LearningRateSchedule. "
                        f"Received: {name}={base!r} (of type {type(base).__name__}).")
    return checks.real(name, base, low=0.0)


def _check_initial(initial, shape):
    if shape not in SHAPES:
        raise ValueError(f"`shape` must be one of {', '.join(repr(s) for s in SHAPES)}. Received: shape={shape!r}")
    value = checks.real("initial", initial, low=0.0, high=1.0)  # a fraction of the base rate
    if shape == "exponential" and value == 0.0:
        raise ValueError("`shape='exponential'` rises geometrically from `initial` and needs initial > 0. "
                         "Received: initial=0.0. Pass e.g. initial=0.01, or use shape='linear'.")
    return value
