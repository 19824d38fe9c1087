"""`kmix.callbacks.LossScaleMonitor`: the loss scale and skipped steps in the logs."""

import warnings

import keras

from kmix import _checks as checks
from kmix.callbacks import _common

ON_MIN_SCALE = ("warn", "raise", "ignore")
_THINNED = object()  # the wrapped train step ran and `log_every` left this batch out


@keras.saving.register_keras_serializable(package="kmix")
class LossScaleMonitor(keras.callbacks.Callback):
    """Logs what the loss scale is doing and reports the gradients that overflow.

    Batch logs get `loss_scale` (the optimizer's current scale),
    `skipped_steps` (all steps it skipped so far) and `overflow_rate` (the
    fraction of the epoch's steps so far that were skipped); epoch logs get
    the three at the epoch's end. Every callback sees them, wherever the
    monitor is listed in `callbacks=` (`CSVLogger`, `TensorBoard`,
    `ModelCheckpoint(monitor="loss_scale")`, ...): during `fit` the monitor
    wraps `model.train_function` so that the keys are in the logs the train
    step returns, before any callback runs, and restores it at the end.

    With `log_every=k` only every k-th batch log has them, and the last one of
    each epoch, so that the epoch logs have them. On an epoch of unknown
    length (a dataset of unknown cardinality) the last batch cannot be told
    in advance, so there every batch log has them.

    When a step overflows while the scale is already at its floor
    (`min_scale`), loss scaling cannot help any more: `on_min_scale="warn"`
    warns once per `fit`, `"raise"` stops training with a
    `FloatingPointError` naming the step and the scale, `"ignore"` does
    nothing. At the end of training, if any step was skipped during it, the
    optimizer's `overflow_report()` is printed: the variables whose gradients
    overflowed most, i.e. the layers that may need float32.

    It only reads a few scalar variables between steps (Keras already copies
    the loss to the host then); nothing is added to the compiled step. Under
    `steps_per_execution > 1` it sees the state after each execution.

    Args:
        on_min_scale: `"warn"`, `"raise"` or `"ignore"`.
        log_every: write the batch logs every `log_every` batches (calls of
            `on_train_batch_end`), an int >= 1; the min-scale check and the
            epoch logs are not thinned.

    Attributes:
        report: the last `overflow_report()` printed (a list of
            `(variable_path, count)`), `[]` when no step was skipped.

    Example:

    >>> model.compile(optimizer=kmix.wrap(keras.optimizers.Adam()), loss="mse")
    >>> history = model.fit(x, y, callbacks=[keras.callbacks.CSVLogger("log.csv"),
    ...                                      kmix.callbacks.LossScaleMonitor()])
    >>> history.history["loss_scale"], history.history["overflow_rate"]
    """

    def __init__(self, on_min_scale="warn", log_every=1):
        super().__init__()
        if on_min_scale not in ON_MIN_SCALE:
            raise ValueError(
                f"`on_min_scale` must be one of {', '.join(repr(v) for v in ON_MIN_SCALE)}. "
                f"Received: on_min_scale={on_min_scale!r}"
            )
        self.on_min_scale = on_min_scale
        self.log_every = checks.integer("log_every", log_every)
        self.report = []

    def on_train_begin(self, logs=None):
        """Records the counters training starts from."""
        self._optimizer = _common.loss_scale_optimizer(self.model, type(self).__name__)
        # An optimizer Keras builds in the first step starts from zero counts.
        self._skipped_at_train_begin = self._counter("skipped_steps")
        self._min_overflows_seen = self._counter("min_scale_overflows")
        self._warned = False
        self._calls = 0
        self._epoch = 0
        self._batch_begin = 0
        self._skipped_at_epoch_begin = self._skipped_at_train_begin
        self._added = None
        self._expect_step = False
        self.report = []
        self._wrap_train_function()

    def on_epoch_begin(self, epoch, logs=None):
        """Records the skip count the epoch starts from."""
        self._epoch = epoch
        self._skipped_at_epoch_begin = self._counter("skipped_steps")
        self._steps_in_epoch = 0

    def on_train_batch_begin(self, batch, logs=None):
        """Wraps the train function again if a callback rebuilt it; notes the batch."""
        self._batch_begin = batch
        self._expect_step = True
        if not isinstance(getattr(self.model, "train_function", None), _LoggingStep):
            self._wrap_train_function()

    def on_train_batch_end(self, batch, logs=None):
        """Checks for min-scale overflows; adds the scalars if the train step did not."""
        # `batch` is the index of the last step of the execution, within the epoch.
        self._steps_in_epoch = batch + 1
        self._expect_step = False
        if self.on_min_scale != "ignore":
            self._check_min_scale(batch)
        added, self._added = self._added, None
        if added is _THINNED:
            added = None
        elif added is None:
            # Not through the wrapped train function (a custom loop driving callbacks).
            self._calls += 1
            if self._calls % self.log_every == 0:
                added = self._scalars(steps_in_epoch=batch + 1)
        if logs is not None and added is not None:
            logs.update(added)

    def on_epoch_end(self, epoch, logs=None):
        """Adds `loss_scale`, `skipped_steps` and `overflow_rate` to the epoch logs."""
        if self.on_min_scale != "ignore":
            self._check_min_scale(None)
        if logs is not None:
            logs.update(self._scalars(self._steps_in_epoch))

    def on_train_end(self, logs=None):
        """Restores the train function; prints the overflow report if a step was skipped."""
        self._unwrap_train_function()
        skipped = self._counter("skipped_steps") - self._skipped_at_train_begin
        if skipped <= 0:
            return
        self.report = self._optimizer.overflow_report()
        print(_format_report(self.report, skipped, _common.read(self._optimizer.loss_scale)))

    def _counter(self, name):
        return _common.read(getattr(self._optimizer, name)) if self._optimizer.built else 0

    def _scalars(self, steps_in_epoch):
        skipped = int(self._counter("skipped_steps"))
        in_epoch = skipped - self._skipped_at_epoch_begin
        return {
            "loss_scale": float(_common.read(self._optimizer.loss_scale)),
            "skipped_steps": skipped,
            "overflow_rate": in_epoch / steps_in_epoch if steps_in_epoch else 0.0,
        }

    # ------------------------------------------------ the wrapped train function
    def _wrap_train_function(self):
        function = getattr(self.model, "train_function", None)
        if function is None:
            return  # not inside `fit`: on_train_batch_end adds the keys itself
        while isinstance(function, _LoggingStep):  # one left by a fit that raised
            function = function.inner
        self.model.train_function = _LoggingStep(function, self)

    def _unwrap_train_function(self):
        function = getattr(self.model, "train_function", None)
        if isinstance(function, _LoggingStep):
            self.model.train_function = function.inner

    def _after_step(self, logs):
        """The keys to add to the logs of the step that just ran, or None (thinned)."""
        self._calls += 1
        steps = self.params.get("steps") if self.params else None
        per_execution = int(getattr(self.model, "steps_per_execution", 1) or 1)
        end = self._batch_begin + per_execution
        last_of_epoch = steps is None or end >= steps
        if self._calls % self.log_every and not last_of_epoch:
            self._added = _THINNED
            return None
        steps_done = end if steps is None else min(end, steps)
        self._added = self._scalars(steps_done)
        return self._added

    def _check_min_scale(self, batch):
        count = self._counter("min_scale_overflows")
        if count <= self._min_overflows_seen:
            return
        new = count - self._min_overflows_seen
        self._min_overflows_seen = count
        scale = float(_common.read(self._optimizer.loss_scale))
        where = f"epoch {self._epoch}" + ("" if batch is None else f", batch {batch}")
        message = (
            f"{new} step(s) overflowed while the loss scale was already at its minimum "
            f"(loss_scale={scale:g}, min_scale={self._optimizer.min_scale:g}), at training step "
            f"{_common.steps_run(self._optimizer)} ({where}). Loss scaling cannot absorb "
            "this: the forward pass or the loss is non-finite (bad data, or an activation "
            "beyond float16's 65504). Keep the overflowing layers in float32 "
            "(see `optimizer.overflow_report()`), lower the learning rate, or check the data."
        )
        if self.on_min_scale == "raise":
            self._unwrap_train_function()  # fit does not call on_train_end after a raise
            raise FloatingPointError(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message + " (LossScaleMonitor warns once per fit.)", RuntimeWarning, stacklevel=2)

    def get_config(self):
        """The constructor arguments."""
        return {"on_min_scale": self.on_min_scale, "log_every": self.log_every}

    @classmethod
    def from_config(cls, config):
        """Re-creates the callback from `get_config()`."""
        return cls(**config)


class _LoggingStep:
    """`model.train_function` with the monitor's scalars added to the logs it returns.

    Keras hands the logs a train step returns to every callback in turn; keys
    entered here reach all of them, and the epoch logs (built from the last
    step's logs when their keys differ from the metrics'). It adds nothing
    unless the monitor expects this step (its `on_train_batch_begin` ran), so
    one left behind by a `fit` that raised is inert.
    """

    def __init__(self, inner, monitor):
        self.inner = inner
        self.monitor = monitor

    def __call__(self, *args, **kwargs):
        expected, self.monitor._expect_step = self.monitor._expect_step, False
        logs = self.inner(*args, **kwargs)
        if not expected or not isinstance(logs, dict):
            return logs
        added = self.monitor._after_step(logs)
        return logs if added is None else {**logs, **added}


def _format_report(report, skipped, scale, top=10):
    """The text `LossScaleMonitor` prints at the end of training.

    Args:
        report: `overflow_report()` rows, `(variable_path, count)`.
        skipped: steps skipped during training.
        scale: the loss scale at the end.
        top: how many rows to show.

    Returns:
        A multi-line string: a summary line and a table of variables.
    """
    lines = [f"LossScaleMonitor: {skipped} step(s) skipped for non-finite gradients; loss scale now {scale:g}."]
    if report:
        width = max(len("variable"), *(len(path) for path, _ in report[:top]))
        lines.append("Gradients that were non-finite most often (a layer at the top may need float32):")
        lines.append(f"  {'variable':<{width}}  overflows")
        lines.extend(f"  {path:<{width}}  {count:>9}" for path, count in report[:top])
        if len(report) > top:
            lines.append(f"  ... and {len(report) - top} more variable(s)")
    return "\n".join(lines)
