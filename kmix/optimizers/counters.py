"""The counters of `kmix.LossScaleOptimizer`: skipped steps, overflows per variable, hysteresis.

Plain functions the optimizer calls: `create` in `build`, `nonfinite` on
every step's gradients, `record_step` once the step is decided (the scale's
state and the counters), `report` for `overflow_report`. The counters are
int64 optimizer variables, so checkpoints and `BackupAndRestore` carry them,
and they stay identical on every replica (every replica takes the same
decision).
"""

import keras
import tensorflow as tf

from kmix import _checks as checks
from kmix.optimizers import scale_rule


def create(opt, num_variables):
    """Creates `opt`'s counters (its attributes `_skipped_steps`, `_overflow_counts`, ...)."""
    opt._skipped_steps = _int_variable(opt, "skipped_steps")
    opt._hysteresis_left = _int_variable(opt, "hysteresis_left", initial=opt.hysteresis)
    opt._overflow_counts = _int_variable(opt, "overflow_counts", shape=(num_variables,))
    opt._min_scale_overflows = _int_variable(opt, "min_scale_overflows")
    opt._growth_interval_var = _int_variable(opt, "current_growth_interval", initial=opt.growth_interval)


def _int_variable(opt, name, shape=(), initial=0):
    return opt.add_variable(
        shape=shape,
        dtype="int64",
        initializer=keras.initializers.Constant(initial),
        aggregation="none",
        name=name,
    )


def built(opt, name):
    """`opt`'s attribute `name`; a `ValueError` saying how to build it when it is not built yet."""
    if not opt.built:
        raise ValueError(
            f"{type(opt).__name__} {opt.name!r} is not built yet: its counters exist once "
            "it has applied a step or `optimizer.build(model.trainable_variables)` was called."
        )
    return getattr(opt, name)


def report(paths, counts, top=None):
    """`(path, count)` rows with `count > 0`, most frequent first, then by path; the first `top` only."""
    if top is not None:
        top = checks.integer("top", top, minimum=0)
    counts = [int(c) for c in tf.convert_to_tensor(counts).numpy()]
    rows = sorted(((p, c) for p, c in zip(paths, counts) if c > 0), key=lambda row: (-row[1], row[0]))
    return rows if top is None else rows[:top]


def nonfinite(opt, grads, variables):
    """A float32 vector, one entry per variable `opt` was built with: 1 where its gradient is non-finite."""
    count = len(opt._model_variables)
    slots = {}
    for g, v in zip(grads, variables):
        if g is not None:
            values = g.values if isinstance(g, tf.IndexedSlices) else g
            slots[opt._index[id(v)]] = tf.reduce_all(tf.math.is_finite(values))
    if not slots:
        return tf.zeros((count,), tf.float32)
    # One stack and one cast for all variables: per-variable casts cost
    # an op each, which shows on models with many small variables.
    finite = tf.stack([slots.get(i, True) for i in range(count)])
    return tf.cast(tf.logical_not(finite), tf.float32)


def record_step(opt, finite, nonfinite, scale, active=None):
    """One step of `scale_rule.ScaleRule` and the counters, written to `opt`; nothing where `active` is False.

    Args:
        opt: the built `kmix.LossScaleOptimizer`.
        finite: whether the step is applied (a boolean scalar).
        nonfinite: `nonfinite(...)` of the step's gradients.
        scale: the scale the step's gradients were taken with.
        active: None, or a boolean scalar: False leaves everything as it is
            (a micro-batch inside an accumulation window).
    """
    rule = scale_rule.ScaleRule(opt._growth_interval_var, opt.growth_factor, opt.backoff_factor,
                                opt.hysteresis, opt.min_scale, opt.max_scale, opt.dynamic)
    before = scale_rule.ScaleState(
        scale, tf.convert_to_tensor(opt.step_counter), tf.convert_to_tensor(opt._hysteresis_left)
    )
    after = rule.adjust(before, finite)
    zero = tf.constant(0, tf.int64)
    skipped = tf.where(finite, zero, 1)
    at_floor = tf.where(scale <= opt.min_scale, skipped, zero)
    overflowed = tf.cast(nonfinite > 0, tf.int64)
    if active is not None:
        after = scale_rule.ScaleState(*(tf.where(active, a, b) for a, b in zip(after, before)))
        skipped, at_floor = (tf.where(active, t, zero) for t in (skipped, at_floor))
        overflowed = tf.where(active, overflowed, tf.zeros_like(overflowed))
    opt.dynamic_scale.assign(after.scale)
    opt.step_counter.assign(tf.cast(after.good_steps, opt.step_counter.dtype))
    opt._hysteresis_left.assign(after.hysteresis_left)
    opt._skipped_steps.assign_add(skipped)
    opt._overflow_counts.assign_add(overflowed)
    opt._min_scale_overflows.assign_add(at_floor)


class CounterViews:
    """The counters of a `kmix.LossScaleOptimizer`, read-only (a base class of it: the optimizer owns them)."""

    @property
    def good_steps(self):
        """Finite steps since the scale last changed (Keras's `step_counter`)."""
        return built(self, "step_counter")

    @property
    def skipped_steps(self):
        """How many steps were skipped for non-finite gradients (an int64 variable)."""
        return built(self, "_skipped_steps")

    @property
    def hysteresis_left(self):
        """Overflows left before the next back-off (an int64 variable)."""
        return built(self, "_hysteresis_left")

    @property
    def overflow_counts(self):
        """Per trainable variable, how often its gradient was non-finite (int64 vector)."""
        return built(self, "_overflow_counts")

    @property
    def min_scale_overflows(self):
        """Overflows that happened while the scale was already at `min_scale`."""
        return built(self, "_min_scale_overflows")

    @property
    def current_growth_interval(self):
        """The growth interval in force (a variable: `LossScaleWarmup` changes it)."""
        return built(self, "_growth_interval_var")

    def overflow_report(self, top=None):
        """The variables whose gradients were non-finite, most frequent first.

        Args:
            top: keep only the first `top` rows; all by default.

        Returns:
            `(variable_path, count)` pairs with `count > 0`, by count (descending), then path.
        """
        counts = self.overflow_counts  # before build: the ValueError saying how to build it
        return report(self._variable_paths, counts, top)
