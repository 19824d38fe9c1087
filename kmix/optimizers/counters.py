"""The counters of `kmix.LossScaleOptimizer`, read-only views of its int64 variables.

A mixin: `LossScaleOptimizer.build` creates the variables (`_skipped_steps`,
`_hysteresis_left`, `_overflow_counts`, `_min_scale_overflows`,
`_growth_interval_var`, Keras's `step_counter`), these read them.
"""

import tensorflow as tf


class Counters:
    """Properties over the loss-scale optimizer's counters, and the overflow report."""

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
