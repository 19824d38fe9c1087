"""`kmix.callbacks.NaNGuard`: roll back to the last good weights on a non-finite loss."""

import math
import warnings

import keras
import numpy as np

from kmix import _checks as checks
from kmix.callbacks import _common
from kmix.optimizers import LossScaleOptimizer
from kmix.schedules import Scaled


@keras.saving.register_keras_serializable(package="kmix")
class NaNGuard(keras.callbacks.Callback):
    """Restores the last good weights on a non-finite loss, lowers the learning rate, and goes on.

    The guard keeps a host copy of the weights and the optimizer's variables, taken when training begins
    and every `snapshot_every` steps whose loss was finite. On a non-finite `logs["loss"]` it copies the
    snapshot back, multiplies the learning rate by `lr_factor` (a schedule becomes
    `kmix.schedules.Scaled`) and resets the metrics; after `max_rollbacks` rollbacks the next one raises
    a `FloatingPointError`. A step that a loss-scale optimizer skipped, leaving every weight and optimizer
    variable finite, is only recorded in `skips`, until `rollback_after_skips` come in a row.

    Args:
        max_rollbacks: rollbacks allowed before training stops, an int >= 0.
        lr_factor: what the learning rate is multiplied by on a rollback, in (0, 1].
        snapshot_every: steps between two snapshots, an int >= 1.
        rollback_after_skips: consecutive non-finite losses, each skipped by the optimizer, after which
            the guard rolls back all the same; an int >= 1 (1: on every non-finite loss).

    Attributes:
        rollbacks: the steps (counted from the start of the last `fit`) at which it rolled back.
        skips: the steps whose non-finite loss the optimizer's skip absorbed.

    Example:

    >>> guard = kmix.callbacks.NaNGuard(max_rollbacks=3, lr_factor=0.5, snapshot_every=100)
    >>> model.fit(ds, callbacks=[guard])
    >>> guard.rollbacks, guard.skips   # e.g. [1234], [87]
    """

    def __init__(self, max_rollbacks=3, lr_factor=0.5, snapshot_every=100, rollback_after_skips=3):
        super().__init__()
        self.max_rollbacks = checks.integer("max_rollbacks", max_rollbacks, minimum=0)
        self.lr_factor = checks.real("lr_factor", lr_factor, low=0.0, high=1.0, low_open=True)
        self.snapshot_every = checks.integer("snapshot_every", snapshot_every)
        self.rollback_after_skips = checks.integer("rollback_after_skips", rollback_after_skips)
        self.rollbacks, self.skips = [], []

    def _restored_variables(self):
        """Model weights and optimizer variables, less the rate and the event counters."""
        optimizer = self.model.optimizer
        if optimizer is None:
            return list(self.model.weights)
        excluded = [_common.learning_rate_of(optimizer)]
        if isinstance(optimizer, LossScaleOptimizer) and optimizer.built:
            excluded += [optimizer.skipped_steps, optimizer.overflow_counts, optimizer.min_scale_overflows]
        return list(self.model.weights) + [v for v in optimizer.variables if all(v is not e for e in excluded)]

    def _take_snapshot(self):
        variables = self._restored_variables()
        values = [_common.to_numpy(v) for v in variables]
        if _all_finite(values[: len(self.model.weights)]):  # never keep a snapshot that is itself broken
            self._snapshot, self._snapshot_step, self._steps_since_snapshot = (variables, values), self._step, 0

    def on_train_begin(self, logs=None):
        """Takes the first snapshot."""
        _common.model_optimizer(self.model, type(self).__name__)
        # Built now, the optimizer's slots are part of the first snapshot; an unbuilt
        # model has no weights yet, and its first snapshot follows its first good batch.
        built = _common.build_optimizer(self.model)
        self.rollbacks, self.skips = [], []
        self._nonfinite_in_a_row = self._step = self._begin = self._snapshot_step = 0
        self._counter_at_begin = self._snapshot = None
        self._steps_since_snapshot = 0 if built else self.snapshot_every
        if built:
            self._take_snapshot()
            if self._snapshot is None:
                raise FloatingPointError("NaNGuard found non-finite weights before training began; there is no "
                                         "good state to roll back to. Re-initialize or reload the model.")

    def on_train_batch_begin(self, batch, logs=None):
        """Remembers where the execution starts, and the optimizer's skip counter."""
        self._begin = batch
        counter = self._skip_counter()
        # A copy on the device (no host sync); read only if the loss is non-finite.
        self._counter_at_begin = None if counter is None else keras.ops.add(counter, 0)

    def on_train_batch_end(self, batch, logs=None):
        """Rolls back on a non-finite loss the optimizer did not absorb; snapshots good steps."""
        steps = max(batch - self._begin + 1, 1)
        self._step += steps
        loss = (logs or {}).get("loss")
        if loss is not None and not _finite(loss):
            self._nonfinite_in_a_row += steps
            if self._nonfinite_in_a_row < self.rollback_after_skips and self._skipped_safely(steps):
                self.skips.append(self._step)
                self.model.reset_metrics()  # the epoch's running loss restarts, finite
                return
            # The streak goes on after a rollback: if the loss stays non-finite, the next
            # one rolls back again (and stops training after `max_rollbacks`).
            self._roll_back(batch)
            return
        self._nonfinite_in_a_row = 0
        self._steps_since_snapshot += steps
        if self._steps_since_snapshot >= self.snapshot_every:
            self._take_snapshot()

    def _skip_counter(self):
        """The optimizer variable that tells a skipped step, or None (not a loss-scale optimizer)."""
        optimizer = getattr(self.model, "optimizer", None)
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or not optimizer.built:
            return None
        # kmix counts skips; Keras's class does not advance `iterations` on one.
        return optimizer.skipped_steps if isinstance(optimizer, LossScaleOptimizer) else optimizer.iterations

    def _skipped_safely(self, steps):
        """Whether the optimizer skipped a step of this execution and every state is finite."""
        counter = self._skip_counter()
        if counter is None or self._counter_at_begin is None:
            return False
        change = _common.read(counter) - _common.to_numpy(self._counter_at_begin).item()
        skipped = change if isinstance(self.model.optimizer, LossScaleOptimizer) else steps - change
        variables = [*self.model.weights, *self.model.optimizer.variables]
        return skipped >= 1 and _all_finite([_common.to_numpy(v) for v in variables])

    def _roll_back(self, batch):
        if self._snapshot is None:
            raise FloatingPointError(
                f"Non-finite loss at training step {self._step} (batch {batch} of the epoch), "
                "before NaNGuard had a snapshot to roll back to (the model was built by its "
                "first step). Build the model before `fit` (keras.Input) to guard from step 1."
            )
        for v, value in zip(*self._snapshot):
            v.assign(value)
        if len(self.rollbacks) >= self.max_rollbacks:
            self.model.stop_training = True
            raise FloatingPointError(
                f"Non-finite loss at training step {self._step} (batch {batch} of the epoch) "
                f"after {len(self.rollbacks)} rollback(s), max_rollbacks={self.max_rollbacks}. "
                f"The weights were restored to the snapshot of step {self._snapshot_step}. Check "
                "the data for inf/NaN, lower the learning rate, or keep overflowing layers in float32."
            )
        self.rollbacks.append(self._step)
        self._scale_learning_rate()
        self.model.reset_metrics()
        self._steps_since_snapshot = 0

    def _scale_learning_rate(self):
        optimizer = self.model.optimizer
        lr = _common.learning_rate_of(optimizer)
        if isinstance(lr, keras.Variable):
            lr.assign(lr * self.lr_factor)
        elif isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            _common.set_learning_rate(optimizer, Scaled.scale(lr, self.lr_factor))
            _common.retrace(self.model)
        else:
            warnings.warn(f"NaNGuard cannot scale a learning rate given as a callable ({lr!r}); it is left "
                          "unchanged. Use a float or a LearningRateSchedule.", stacklevel=2)

    def get_config(self):
        """The constructor arguments."""
        return {"max_rollbacks": self.max_rollbacks, "lr_factor": self.lr_factor,
                "snapshot_every": self.snapshot_every, "rollback_after_skips": self.rollback_after_skips}

    @classmethod
    def from_config(cls, config):
        """Re-creates the callback from `get_config()`."""
        return cls(**config)


def _all_finite(values):
    return all(np.all(np.isfinite(v)) for v in values if np.issubdtype(v.dtype, np.floating))


def _finite(value):
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return bool(np.all(np.isfinite(np.asarray(value))))
