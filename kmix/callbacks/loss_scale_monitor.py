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

    Batch and epoch logs get `loss_scale`, `skipped_steps` (all skipped so far) and `overflow_rate` (the
    share of the epoch's steps skipped), in the logs the train step returns, so every callback sees them
    wherever the monitor is listed. At the end of a `fit` that skipped steps, the optimizer's
    `overflow_report()` is printed: the variables whose gradients overflowed most.

    Args:
        on_min_scale: what an overflow at the scale's floor (`min_scale`) does: `"warn"` (once per
            `fit`), `"raise"` (a `FloatingPointError` naming the step) or `"ignore"`.
        log_every: add the keys to every `log_every`-th batch log (and the epoch's last), an int >= 1.

    Attributes:
        report: the last `overflow_report()` printed (`[(variable_path, count)]`), `[]` when none.

    Example:

    >>> model.compile(optimizer=kmix.wrap(keras.optimizers.Adam()), loss="mse")
    >>> history = model.fit(x, y, callbacks=[kmix.callbacks.LossScaleMonitor()])
    >>> history.history["loss_scale"], history.history["overflow_rate"]
    """

    def __init__(self, on_min_scale="warn", log_every=1):
        super().__init__()
        if on_min_scale not in ON_MIN_SCALE:
            raise ValueError(f"`on_min_scale` must be one of {', '.join(repr(v) for v in ON_MIN_SCALE)}. "
                             f"Received: on_min_scale={on_min_scale!r}")
        self.on_min_scale = on_min_scale
        self.log_every = checks.integer("log_every", log_every)
        self.report = []

    def on_train_begin(self, logs=None):
        """Builds the optimizer (else built in the first step, traced twice), records its counters, wraps the step."""
        self._optimizer = _common.loss_scale_optimizer(self.model, type(self).__name__)
        _common.build_optimizer(self.model)  # an unbuilt model's optimizer: built in the first step, counts from zero
        self._skipped_at_train_begin = self._skipped_at_epoch_begin = self._counter("skipped_steps")
        self._min_overflows_seen = self._counter("min_scale_overflows")
        self._warned, self._calls, self._epoch, self._batch_begin, self._added = False, 0, 0, 0, None
        self.report = []
        self._wrap_train_function()

    def on_epoch_begin(self, epoch, logs=None):
        """Records the skip count the epoch starts from."""
        self._epoch, self._steps_in_epoch = epoch, 0
        self._skipped_at_epoch_begin = self._counter("skipped_steps")

    def on_train_batch_begin(self, batch, logs=None):
        """Wraps the train function again if a callback rebuilt it; tells it the step `fit` runs next."""
        self._batch_begin = batch
        step = getattr(self.model, "train_function", None)
        if not isinstance(step, _LoggingStep):
            step = self._wrap_train_function()
        if step is not None:
            step.expected = True

    def on_train_batch_end(self, batch, logs=None):
        """Checks for min-scale overflows; adds the scalars if the train step did not."""
        self._steps_in_epoch = batch + 1  # `batch`: the execution's last step, within the epoch
        step = getattr(self.model, "train_function", None)
        if isinstance(step, _LoggingStep):
            step.expected = False
        if self.on_min_scale != "ignore":
            self._check_min_scale(batch)
        added, self._added = self._added, None
        if added is _THINNED:
            added = None
        elif added is None:  # not through the wrapped train function (a custom loop driving callbacks)
            self._calls += 1
            added = self._scalars(batch + 1) if self._calls % self.log_every == 0 else None
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
        if skipped > 0:
            self.report = self._optimizer.overflow_report()
            print(_format_report(self.report, skipped, _common.read(self._optimizer.loss_scale)))

    def _counter(self, name):
        return _common.read(getattr(self._optimizer, name)) if self._optimizer.built else 0

    def _scalars(self, steps_in_epoch):
        skipped = int(self._counter("skipped_steps"))
        return {"loss_scale": float(_common.read(self._optimizer.loss_scale)), "skipped_steps": skipped,
                "overflow_rate": (skipped - self._skipped_at_epoch_begin) / steps_in_epoch if steps_in_epoch else 0.0}

    def _wrap_train_function(self):
        """The model's train function wrapped in a `_LoggingStep`; None outside `fit`."""
        function = getattr(self.model, "train_function", None)
        if function is None:
            return None  # not inside `fit`: on_train_batch_end adds the keys itself
        while isinstance(function, _LoggingStep):  # one left by a fit that raised
            function = function.inner
        self.model.train_function = _LoggingStep(function, self)
        return self.model.train_function

    def _unwrap_train_function(self):
        function = getattr(self.model, "train_function", None)
        if isinstance(function, _LoggingStep):
            self.model.train_function = function.inner

    def logs_after_step(self):
        """The keys the wrapped train step adds to its logs, or None where `log_every` thins this batch out."""
        self._calls += 1
        steps = self.params.get("steps") if self.params else None
        end = self._batch_begin + int(getattr(self.model, "steps_per_execution", 1) or 1)
        if self._calls % self.log_every and not (steps is None or end >= steps):  # not the epoch's last
            self._added = _THINNED
            return None
        self._added = self._scalars(end if steps is None else min(end, steps))
        return self._added

    def _check_min_scale(self, batch):
        count = self._counter("min_scale_overflows")
        if count <= self._min_overflows_seen:
            return
        new, self._min_overflows_seen = count - self._min_overflows_seen, count
        where = f"epoch {self._epoch}" + ("" if batch is None else f", batch {batch}")
        message = (f"{new} step(s) overflowed while the loss scale was already at its minimum "
                   f"(loss_scale={float(_common.read(self._optimizer.loss_scale)):g}, min_scale="
                   f"{self._optimizer.min_scale:g}), at training step {_common.steps_run(self._optimizer)} "
                   f"({where}). Loss scaling cannot absorb this: the forward pass or the loss is non-finite (bad "
                   "data, or an activation beyond float16's 65504). Keep the overflowing layers in float32 (see "
                   "`optimizer.overflow_report()`), lower the learning rate, or check the data.")
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
    """`model.train_function` with the monitor's scalars added to the logs it returns, before any callback runs.

    It adds them only to a step the monitor announced (`expected`), so one left by a `fit` that raised is inert.
    """

    def __init__(self, inner, monitor):
        self.inner, self.monitor, self.expected = inner, monitor, False

    def __call__(self, *args, **kwargs):
        expected, self.expected = self.expected, False
        logs = self.inner(*args, **kwargs)
        added = self.monitor.logs_after_step() if expected and isinstance(logs, dict) else None
        return logs if added is None else {**logs, **added}


def _format_report(report, skipped, scale, top=10):
    """The text printed at the end of training: a summary line and the `top` variables of `report`."""
    lines = [f"LossScaleMonitor: {skipped} step(s) skipped for non-finite gradients; loss scale now {scale:g}."]
    if report:
        width = max(len("variable"), *(len(path) for path, _ in report[:top]))
        lines += ["Gradients that were non-finite most often (a layer at the top may need float32):",
                  f"  {'variable':<{width}}  overflows"]
        lines += [f"  {path:<{width}}  {count:>9}" for path, count in report[:top]]
        if len(report) > top:
            lines.append(f"  ... and {len(report) - top} more variable(s)")
    return "\n".join(lines)
