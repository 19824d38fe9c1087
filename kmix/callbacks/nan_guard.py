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
    """Restores the last good weights on a non-finite loss, lowers the rate, goes on.

    Loss scaling absorbs overflowing *gradients*; a non-finite *loss* (a bad
    batch, a float32 overflow, weights that already diverged) it cannot
    always. The guard keeps an in-memory copy of the model's weights and the
    optimizer's variables, taken when training begins and then every
    `snapshot_every` steps whose loss was finite.

    When a batch ends with a non-finite loss and the optimizer is a
    loss-scale optimizer (`kmix.wrap`, or Keras's own) that *skipped* that
    step, the weights did not move: if they and the optimizer's variables
    are all finite, the guard does not roll back nor touch the rate. It
    resets the model's metrics (so the epoch's running loss stays finite)
    and records the step in `skips`. It rolls back when the loss has been
    non-finite for `rollback_after_skips` steps in a row (3 by default: the
    third consecutive one rolls back), since a model whose every batch
    overflows will not recover by skipping. Otherwise, i.e. when the step
    was not skipped, or weights or optimizer state are non-finite, it

    1. copies the snapshot back (bit for bit),
    2. multiplies the learning rate by `lr_factor`,
    3. resets the model's metrics, so the epoch's running loss restarts
       without the non-finite value, and training goes on with the next batch.

    After `max_rollbacks` rollbacks the next rollback restores the snapshot
    one last time and raises a `FloatingPointError` naming the step.
    Unlike `keras.callbacks.TerminateOnNaN`, at most `snapshot_every` steps of
    work are lost.

    Details:

    - The learning rate: a float rate is multiplied in place. A schedule
      becomes `kmix.schedules.Scaled(schedule, lr_factor)` (factors multiply
      on later rollbacks) and the train step is traced again, once per
      rollback. A rate given as a plain callable is left unchanged, with a
      warning. The rate itself is not part of the snapshot, so rollbacks
      compound: after two, the rate is `lr * lr_factor**2`.
    - The optimizer's `iterations` go back with the weights (a warm-up
      schedule follows them). A `kmix.LossScaleOptimizer`'s scale and
      hysteresis go back too; its counters of skipped steps and overflows
      do not, since they count what happened.
    - The loss checked is `logs["loss"]`, which in Keras 3 is the epoch's
      running mean: a single non-finite batch makes it non-finite, and the
      metric reset clears it. Under `steps_per_execution > 1` the guard sees
      the loss after each execution, and an execution counts as skipped when
      the optimizer skipped at least one of its steps.
    - Whether a step was skipped is read from the optimizer's counters
      (`skipped_steps`, or `iterations` for Keras's class), copied on the
      device before each batch and read on the host only when a loss is
      non-finite. Checking the weights and the optimizer's variables then
      copies them to the host: once per non-finite loss.
    - Snapshots are host copies of every weight: with a large model pick
      `snapshot_every` so that the copy is cheap next to the steps between.

    Args:
        max_rollbacks: rollbacks allowed before training stops, an int >= 0.
        lr_factor: what the learning rate is multiplied by on a rollback,
            in (0, 1].
        snapshot_every: steps between two snapshots, an int >= 1.
        rollback_after_skips: consecutive steps with a non-finite loss, each
            skipped by the optimizer, after which the guard rolls back all
            the same; an int >= 1 (1: roll back on every non-finite loss).

    Attributes:
        rollbacks: the steps, counted from the start of the last `fit`, at
            which the guard rolled back.
        skips: the steps whose non-finite loss the optimizer's skip absorbed
            (no rollback, rate unchanged).

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
        self.rollbacks = []
        self.skips = []

    # ------------------------------------------------------------ snapshots
    def _restored_variables(self):
        """Model weights and optimizer variables, less the rate and the event counters."""
        optimizer = self.model.optimizer
        excluded = set()
        lr = _common.learning_rate_of(optimizer) if optimizer is not None else None
        if isinstance(lr, keras.Variable):
            excluded.add(id(lr))
        if isinstance(optimizer, LossScaleOptimizer) and optimizer.built:
            for v in (optimizer.skipped_steps, optimizer.overflow_counts, optimizer.min_scale_overflows):
                excluded.add(id(v))
        variables = list(self.model.weights)
        if optimizer is not None:
            variables += [v for v in optimizer.variables if id(v) not in excluded]
        return variables

    def _take_snapshot(self):
        variables = self._restored_variables()
        values = [_common.to_numpy(v) for v in variables]
        weights = values[: len(self.model.weights)]
        if not all(np.all(np.isfinite(w)) for w in weights if np.issubdtype(w.dtype, np.floating)):
            return  # never keep a snapshot that is itself broken
        self._snapshot = (variables, values)
        self._snapshot_step = self._step
        self._steps_since_snapshot = 0

    def _restore_snapshot(self):
        variables, values = self._snapshot
        for v, value in zip(variables, values):
            v.assign(value)

    # ------------------------------------------------------------ callbacks
    def on_train_begin(self, logs=None):
        """Takes the first snapshot."""
        _common.model_optimizer(self.model, type(self).__name__)
        # Built now, the optimizer's slots are part of the first snapshot; an unbuilt
        # model has no weights yet, and its first snapshot follows its first good batch.
        built = _common.build_optimizer(self.model)
        self.rollbacks = []
        self.skips = []
        self._nonfinite_in_a_row = 0
        self._counter_at_begin = None
        self._step = 0
        self._begin = 0
        self._snapshot = None
        self._snapshot_step = 0
        self._steps_since_snapshot = 0
        if not built:
            self._steps_since_snapshot = self.snapshot_every  # snapshot after the first good batch
            return
        self._take_snapshot()
        if self._snapshot is None:
            raise FloatingPointError(
                "NaNGuard found non-finite weights before training began; there is no good "
                "state to roll back to. Re-initialize or reload the model."
            )

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
        if skipped < 1:
            return False
        values = [_common.to_numpy(v) for v in list(self.model.weights) + list(self.model.optimizer.variables)]
        return all(np.all(np.isfinite(v)) for v in values if np.issubdtype(v.dtype, np.floating))

    def _roll_back(self, batch):
        if self._snapshot is None:
            raise FloatingPointError(
                f"Non-finite loss at training step {self._step} (batch {batch} of the epoch), "
                "before NaNGuard had a snapshot to roll back to (the model was built by its "
                "first step). Build the model before `fit` (keras.Input) to guard from step 1."
            )
        self._restore_snapshot()
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
            warnings.warn(
                f"NaNGuard cannot scale a learning rate given as a callable ({lr!r}); it is "
                "left unchanged. Use a float or a LearningRateSchedule.",
                stacklevel=2,
            )

    def get_config(self):
        """The constructor arguments."""
        return {
            "max_rollbacks": self.max_rollbacks,
            "lr_factor": self.lr_factor,
            "snapshot_every": self.snapshot_every,
            "rollback_after_skips": self.rollback_after_skips,
        }

    @classmethod
    def from_config(cls, config):
        """Re-creates the callback from `get_config()`."""
        return cls(**config)


def _finite(value):
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return bool(np.all(np.isfinite(np.asarray(value))))
