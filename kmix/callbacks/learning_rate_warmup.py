"""`kmix.callbacks.LearningRateWarmup`: learning-rate warm-up in one line of `callbacks=`."""

import keras

from kmix.callbacks import _common
from kmix.schedules import Scaled, Warmup


@keras.saving.register_keras_serializable(package="kmix")
class LearningRateWarmup(keras.callbacks.Callback):
    """Installs a `kmix.schedules.Warmup` on the model's optimizer when training begins.

    The optimizer's learning rate (of the inner optimizer under a loss-scale
    optimizer) becomes the warm-up's `base`: a float rate is read once, a
    schedule is wrapped and keeps running. The warm-up is a schedule of
    `optimizer.iterations`, computed in the compiled step, so it is exact
    under `jit_compile=True` and `steps_per_execution > 1`, and a run resumed
    from a checkpoint (`model.save` / `load_model`, `BackupAndRestore`)
    continues where it stopped.

    Conventions:

    - A step skipped for an overflow does not advance `iterations`, so it does
      not advance the warm-up: the warm-up lasts `warmup_steps` *applied*
      updates.
    - A rate that is already this warm-up (a resumed or loaded model) is left
      as it is; a `Warmup` with other settings is replaced, around its base.
    - The rate becomes a schedule: callbacks that assign a float rate
      (`ReduceLROnPlateau`, `LearningRateScheduler`) cannot be combined with it.
      The float rate's variable is no longer an optimizer variable, so a
      checkpoint written before the warm-up was installed has one optimizer
      variable more. The callback installs the schedule as soon as `fit`
      hands it the model, before any `on_train_begin`, so a
      `BackupAndRestore` anywhere in `callbacks=` restores into the same
      layout it saved.

    Args:
        warmup_steps: applied updates the warm-up lasts, an int >= 0.
        initial: the fraction of the base rate it starts from, in [0, 1].
        shape: `"linear"`, `"exponential"` (needs `initial > 0`) or `"cosine"`.

    Attributes:
        schedule: the `Warmup` in force once training began (else `None`).

    Example:

    >>> model.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(3e-4)), loss="mse")
    >>> model.fit(x, y, callbacks=[kmix.callbacks.LearningRateWarmup(1000)])
    >>> model.optimizer.inner_optimizer.learning_rate   # 3e-4 from step 1000 on
    """

    def __init__(self, warmup_steps, initial=0.0, shape="linear"):
        super().__init__()
        checked = Warmup(1.0, warmup_steps, initial, shape)  # validates, naming the argument
        self.warmup_steps = checked.warmup_steps
        self.initial = checked.initial
        self.shape = checked.shape
        self.schedule = None

    def set_model(self, model):
        """Keeps the model and installs the warm-up if it is compiled already."""
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
        if warmup is not None and self._matches(warmup):
            self.schedule = warmup
            return
        if warmup is not None:
            base = warmup.base
        elif isinstance(current, keras.optimizers.schedules.LearningRateSchedule):
            base = current
        elif isinstance(current, keras.Variable):
            base = float(_common.read(current))
        else:
            raise TypeError(
                f"{type(self).__name__} wraps a float learning rate or a keras.optimizers."
                "schedules.LearningRateSchedule; received an optimizer whose learning rate is "
                f"{current!r} (of type {type(current).__name__}). Pass a schedule instead of "
                "a callable, or use kmix.schedules.Warmup directly."
            )
        self.schedule = Warmup(base, self.warmup_steps, self.initial, self.shape)
        new = self.schedule if factor is None else Scaled(self.schedule, factor)
        _common.set_learning_rate(optimizer, new)
        _common.retrace(self.model)

    def _matches(self, warmup):
        return (warmup.warmup_steps, warmup.initial, warmup.shape) == (
            self.warmup_steps,
            self.initial,
            self.shape,
        )

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
