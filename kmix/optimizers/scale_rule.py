"""The loss-scale rule of `kmix.LossScaleOptimizer`, in-graph and branch-free.

```
if not finite:
    skipped += 1; good = 0; hysteresis_left -= 1
    if dynamic and hysteresis_left <= 0: scale = max(scale * backoff_factor, min_scale)
else:
    good += 1
    if dynamic and good >= growth_interval:
        good = 0; hysteresis_left = hysteresis; scale = min(scale * growth_factor, max_scale)
```
"""

import tensorflow as tf


def update(opt, finite, nonfinite, scale, active=None):
    """Advances `opt`'s scale and counters by one step; nothing changes where `active` is False.

    Args:
        opt: the built `kmix.LossScaleOptimizer`.
        finite: boolean scalar, the step's gradients were all finite.
        nonfinite: float32 vector, 1 per variable whose gradient was not.
        scale: the scale the step used.
        active: boolean scalar or None; False inside an accumulation window.
    """
    one = tf.constant(1, tf.int64)
    zero = tf.constant(0, tf.int64)
    good = tf.where(finite, tf.convert_to_tensor(opt.step_counter) + 1, 0)
    # `>=` rather than `==`: the same trajectory, and safe when LossScaleWarmup
    # lowers the interval below a count that has already passed it.
    grow = tf.logical_and(finite, tf.cast(good, tf.int64) >= opt._growth_interval_var)
    grow = tf.logical_and(grow, opt.dynamic)
    hysteresis_left = tf.where(
        finite,
        tf.where(grow, tf.constant(opt.hysteresis, tf.int64), opt._hysteresis_left),
        tf.maximum(opt._hysteresis_left - 1, zero),
    )
    new_scale = scale
    if opt.dynamic:
        backoff = tf.logical_and(tf.logical_not(finite), hysteresis_left <= 0)
        new_scale = tf.where(grow, tf.minimum(scale * opt.growth_factor, opt.max_scale), scale)
        new_scale = tf.where(
            backoff, tf.maximum(scale * opt.backoff_factor, opt.min_scale), new_scale
        )
    skipped = tf.where(finite, zero, one)
    overflowed = tf.cast(nonfinite > 0, tf.int64)
    at_floor = tf.where(scale <= opt.min_scale, skipped, zero)
    good = tf.where(grow, tf.zeros_like(good), good)
    if active is not None:
        keep = tf.logical_not(active)
        good = tf.where(keep, opt.step_counter, good)
        hysteresis_left = tf.where(keep, opt._hysteresis_left, hysteresis_left)
        new_scale = tf.where(keep, scale, new_scale)
        skipped, at_floor = (tf.where(keep, zero, t) for t in (skipped, at_floor))
        overflowed = tf.where(keep, tf.zeros_like(overflowed), overflowed)
    opt.step_counter.assign(good)
    opt._hysteresis_left.assign(hysteresis_left)
    opt.dynamic_scale.assign(new_scale)
    opt._skipped_steps.assign_add(skipped)
    opt._overflow_counts.assign_add(overflowed)
    opt._min_scale_overflows.assign_add(at_floor)
