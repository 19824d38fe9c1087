"""The counters of `kmix.LossScaleOptimizer`: skipped steps, overflows per variable, hysteresis.

A mixin: the optimizer creates them in `build` (`_create_counters`) and
`_update_state` writes them once per step. They are int64 optimizer
variables, so checkpoints and `BackupAndRestore` carry them, and they stay
identical on every replica (every replica takes the same decision).
"""

import keras
import tensorflow as tf


class LossScaleCounters:
    """Read access to the loss-scale counters, and their creation."""

    def _create_counters(self, num_variables):
        self._skipped_steps = self._int_variable("skipped_steps")
        self._hysteresis_left = self._int_variable("hysteresis_left", initial=self.hysteresis)
        self._overflow_counts = self._int_variable("overflow_counts", shape=(num_variables,))
        self._min_scale_overflows = self._int_variable("min_scale_overflows")
        self._growth_interval_var = self._int_variable("current_growth_interval", initial=self.growth_interval)

    def _int_variable(self, name, shape=(), initial=0):
        return self.add_variable(
            shape=shape,
            dtype="int64",
            initializer=keras.initializers.Constant(initial),
            aggregation="none",
            name=name,
        )

    @property
    def good_steps(self):
        """Finite steps since the scale last changed (Keras's `step_counter`)."""
        return self._built_attr("step_counter")

    @property
    def skipped_steps(self):
        """How many steps were skipped for non-finite gradients (an int64 variable)."""
        return self._built_attr("_skipped_steps")

    @property
    def hysteresis_left(self):
        """Overflows left before the next back-off (an int64 variable)."""
        return self._built_attr("_hysteresis_left")

    @property
    def overflow_counts(self):
        """Per trainable variable, how often its gradient was non-finite (int64 vector)."""
        return self._built_attr("_overflow_counts")

    @property
    def min_scale_overflows(self):
        """Overflows that happened while the scale was already at `min_scale`."""
        return self._built_attr("_min_scale_overflows")

    @property
    def current_growth_interval(self):
        """The growth interval in force (a variable: `LossScaleWarmup` changes it)."""
        return self._built_attr("_growth_interval_var")

    def _built_attr(self, name):
        if not self.built:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} is not built yet: its counters exist once "
                "it has applied a step or `optimizer.build(model.trainable_variables)` was called."
            )
        return getattr(self, name)

    def overflow_report(self, top=None):
        """The variables whose gradients were non-finite, most frequent first.

        Args:
            top: keep only the first `top` rows; all by default.

        Returns:
            A list of `(variable_path, count)` with `count > 0`, sorted by count
            (descending), then path.
        """
        counts = [int(c) for c in tf.convert_to_tensor(self.overflow_counts).numpy()]
        rows = sorted(
            ((p, c) for p, c in zip(self._variable_paths, counts) if c > 0),
            key=lambda row: (-row[1], row[0]),
        )
        return rows if top is None else rows[:top]

    def _nonfinite_per_variable(self, grads, variables):
        """A float32 vector, one entry per built variable: 1 where its gradient is non-finite."""
        slots = {}
        for g, v in zip(grads, variables):
            if g is not None:
                values = g.values if isinstance(g, tf.IndexedSlices) else g
                slots[self._index[id(v)]] = tf.reduce_all(tf.math.is_finite(values))
        if not slots:
            return tf.zeros((len(self._model_variables),), tf.float32)
        # One stack and one cast for all variables: per-variable casts cost
        # an op each, which shows on models with many small variables.
        finite = tf.stack([slots.get(i, True) for i in range(len(self._model_variables))])
        return tf.cast(tf.logical_not(finite), tf.float32)
