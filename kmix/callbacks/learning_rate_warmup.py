"""`kmix.callbacks.LearningRateWarmup`: learning-rate warm-up in one line of `callbacks=`."""

import keras

from kmix.callbacks import _common
from kmix.schedules import Scaled, Warmup


@keras.saving.register_keras_serializable(package="kmix")
class LearningRateWarmup(keras.callbacks.Callback):
    """Installs a `kmix.schedules.Warmup` on the model's optimizer when training begins.

    The optimizer's learning rate (the inner optimizer's under a loss-scale optimizer) becomes the
    warm-up's `base`: a float is read once, a schedule is wrapped and keeps running. The warm-up follows
    `optimizer.iterations`, so it counts applied updates (a skipped step does not advance it) and a
    resumed run continues where it stopped. A rate that is already this warm-up is left as it is.

    Args:
        warmup_steps: applied updates the warm-up lasts, an int >= 0.
        initial: the fraction of the base rate it starts from, in [0, 1].
        shape: `"linear"`, `"exponential"` (needs `initial > 0`) or `"cosine"`.

    Attributes:
        schedule: the `Warmup` in force once training began (else `None`).

    Example:

    >>> model.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(3e-4)), loss="mse")
    >>> model.fit(x, y, callbacks=[kmix.callbacks.LearningRateWarmup(1000)])
    """

    def __init__(self, warmup_steps, initial=0.0, shape="linear"):
        super().__init__()
        checked = Warmup(1.0, warmup_steps, initial, shape)  # validates, naming the argument
        self.warmup_steps, self.initial, self.shape = checked.warmup_steps, checked.initial, checked.shape
        self.schedule = None

    def set_model(self, model):
        """Keeps the model and installs the warm-up if it is compiled already (before any `on_train_begin`,
        so that a `BackupAndRestore` anywhere in `callbacks=` restores into the layout it saved)."""
        super().set_model(model)
        if getattr(model, "optimizer", None) is not None:
            self._install()

    def on_train_begin(self, logs=None):
        """Installs the warm-up (if `set_model` could not) and retraces a stale step."""
        self._install()

    def _install(self):
        optimizer = _common.model_optimizer(self.model, type(self).__name__)
        current = _common.learning_rate_of(optimizer)
        warmup, factor = _split(current)
        if warmup is not None and (warmup.warmup_steps, warmup.initial, warmup.shape) == (
                self.warmup_steps, self.initial, self.shape):
            self.schedule = warmup
            return
        if warmup is not None:
            base = warmup.base
        elif isinstance(current, keras.optimizers.schedules.LearningRateSchedule):
            base = current
        elif isinstance(current, keras.Variable):
            base = float(_common.read(current))
        else:
            raise TypeError(f"{type(self).__name__} wraps a float learning rate or a keras.optimizers.schedules."
                            f"LearningRateSchedule; received an optimizer whose learning rate is {current!r} (of "
                            f"type {type(current).__name__}). Pass a schedule instead of a callable, or use "
                            "kmix.schedules.Warmup directly.")
        self.schedule = Warmup(base, self.warmup_steps, self.initial, self.shape)
        new = self.schedule if factor is None else Scaled(self.schedule, factor)
        _common.set_learning_rate(optimizer, new)
        _common.retrace(self.model)

    def get_config(self):
        """The constructor arguments."""
        return {"warmup_steps": self.warmup_steps, "initial": self.initial, "shape": self.shape}

    @classmethod
    def from_config(cls, config):
        """Re-creates the callback from `get_config()`."""
        return cls(**config)


def _split(learning_rate):
    """`(warmup, factor)` for a `Warmup` or a `Scaled(Warmup)` (NaNGuard's), else `(None, None)`."""
    if isinstance(learning_rate, Warmup):
        return learning_rate, None
    if isinstance(learning_rate, Scaled) and isinstance(learning_rate.schedule, Warmup):
        return learning_rate.schedule, learning_rate.factor
    return None, None
