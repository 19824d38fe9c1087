"""The dynamic loss-scale rule as a pure function: (state, finite) -> new state.

`kmix.LossScaleOptimizer` keeps the state in variables and calls
`ScaleRule.adjust` once per optimizer step; nothing here reads or writes a
variable, so the rule is tested alone against a plain-Python run of the
pseudo-code below (tests/optimizers/test_scale_rule.py).
"""

from typing import NamedTuple

import tensorflow as tf


class ScaleState(NamedTuple):
    """The loss scale's state between two steps.

    Attributes:
        scale: the loss scale, a float32 scalar.
        good_steps: finite steps since the scale last grew or an overflow
            happened, an int64 scalar (Keras's `step_counter`).
        hysteresis_left: overflows still tolerated before the next back-off,
            an int64 scalar.
    """

    scale: tf.Tensor
    good_steps: tf.Tensor
    hysteresis_left: tf.Tensor


class ScaleRule(NamedTuple):
    """How the loss scale reacts to one step's finite flag.

    ```
    if not finite:                         # the step is skipped
        good_steps = 0; hysteresis_left -= 1   (never below 0)
        if dynamic and hysteresis_left <= 0: scale = max(scale * backoff_factor, min_scale)
    else:
        good_steps += 1
        if dynamic and good_steps >= growth_interval:
            good_steps = 0; hysteresis_left = hysteresis
            scale = min(scale * growth_factor, max_scale)
    ```

    With `hysteresis=1` and the bounds out of reach this is
    `torch.amp.GradScaler`'s trajectory; with `hysteresis=2` it is
    Megatron-LM's. `>=` rather than `==`: the same trajectory, and a growth at
    the next finite step when `growth_interval` (a variable that
    `kmix.callbacks.LossScaleWarmup` lowers) drops below a count already passed.

    Attributes:
        growth_interval: finite steps between two growths (int, or an int64
            tensor or variable).
        growth_factor: the scale's factor on growth, > 1.
        backoff_factor: the scale's factor on a back-off, in (0, 1).
        hysteresis: overflows tolerated before the scale backs off, >= 1.
        min_scale: the scale's floor.
        max_scale: the scale's cap.
        dynamic: False keeps the scale; the counters still move.

    Example:

    >>> rule = ScaleRule(2000, 2.0, 0.5, 1, 1.0, 2.0**24, True)
    >>> state = ScaleState(tf.constant(2.0**15), tf.constant(0, tf.int64), tf.constant(1, tf.int64))
    >>> for finite in step_results:
    ...     state = rule.adjust(state, finite)
    """

    growth_interval: object
    growth_factor: float
    backoff_factor: float
    hysteresis: int
    min_scale: float
    max_scale: float
    dynamic: bool = True

    def adjust(self, state, finite):
        """The state after one step whose gradients were `finite` (a boolean scalar).

        Args:
            state: the `ScaleState` before the step.
            finite: True when the step was applied, False when it was skipped.

        Returns:
            The `ScaleState` after the step (tensors).
        """
        finite = tf.convert_to_tensor(finite, tf.bool)
        scale = tf.convert_to_tensor(state.scale, tf.float32)
        good_before = tf.cast(state.good_steps, tf.int64)
        left_before = tf.cast(state.hysteresis_left, tf.int64)
        good = tf.where(finite, good_before + 1, tf.zeros_like(good_before))
        grow = tf.logical_and(finite, good >= tf.cast(self.growth_interval, tf.int64))
        grow = tf.logical_and(grow, self.dynamic)
        left = tf.where(
            finite,
            tf.where(grow, tf.constant(self.hysteresis, tf.int64), left_before),
            tf.maximum(left_before - 1, 0),
        )
        new_scale = scale
        if self.dynamic:
            backoff = tf.logical_and(tf.logical_not(finite), left <= 0)
            new_scale = tf.where(grow, tf.minimum(scale * self.growth_factor, self.max_scale), scale)
            new_scale = tf.where(backoff, tf.maximum(scale * self.backoff_factor, self.min_scale), new_scale)
        return ScaleState(new_scale, tf.where(grow, tf.zeros_like(good), good), left)
