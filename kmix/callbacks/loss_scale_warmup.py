"""`kmix.callbacks.LossScaleWarmup`: start the loss scale low and let it climb fast."""

import warnings

import keras

from kmix import _checks as checks
from kmix.callbacks import _common


@keras.saving.register_keras_serializable(package="kmix")
class LossScaleWarmup(keras.callbacks.Callback):
    """Starts the loss scale low and grows it quickly until it first overflows.

    On a fresh optimizer it sets the scale to `initial_scale` and the growth interval to `growth_interval`;
    at the first overflow, or after `steps` steps, it puts the optimizer's own `growth_interval` back:

    ```
    on train begin, if the optimizer has run no step:
        loss_scale = initial_scale; current_growth_interval = growth_interval
    after each batch, while warming up:
        if skipped_steps > 0 or steps_run >= steps:
            current_growth_interval = optimizer.growth_interval     # done
    ```

    The interval is an optimizer variable, so a resumed run continues a warm-up in progress. An optimizer
    that already ran steps is left alone, as is one with a fixed scale (with a warning).

    Args:
        initial_scale: the scale to start from, > 0 and within the optimizer's [min_scale, max_scale].
        growth_interval: finite steps between two growths during the warm-up, an int >= 1.
        steps: the longest the warm-up lasts, in steps, an int >= 1.

    Attributes:
        finished_at: the training step at which the warm-up ended (`None` while it runs or if it never started).

    Example:

    >>> model.compile(optimizer=kmix.wrap(keras.optimizers.Adam()), loss="mse")
    >>> model.fit(x, y, callbacks=[kmix.callbacks.LossScaleWarmup(2**7, growth_interval=20)])
    """

    def __init__(self, initial_scale=2**7, growth_interval=20, steps=1000):
        super().__init__()
        self.initial_scale = checks.real("initial_scale", initial_scale, low=0.0, low_open=True)
        self.growth_interval = checks.integer("growth_interval", growth_interval)
        self.steps = checks.integer("steps", steps)
        self.finished_at = None
        self._active = False

    def on_train_begin(self, logs=None):
        """Lowers the scale and shortens the interval on a fresh optimizer."""
        optimizer = _common.loss_scale_optimizer(self.model, type(self).__name__)
        if not _common.build_optimizer(self.model):
            raise ValueError(f"{type(self).__name__} sets the loss scale before the first step, so the model must be "
                             "built before `fit`: start it with `keras.Input(...)` or call it on a batch first. "
                             f"Received: an unbuilt model {self.model.name!r}.")
        self._optimizer = optimizer
        self._active = False
        if not optimizer.dynamic:
            warnings.warn(f"{type(self).__name__} does nothing: the optimizer's loss scale is fixed (dynamic=False, "
                          f"scale {_common.read(optimizer.loss_scale):g}), as kmix.wrap makes it under a float32 "
                          "or bfloat16 policy.", stacklevel=2)
            return
        if not optimizer.min_scale <= self.initial_scale <= optimizer.max_scale:
            raise ValueError("`initial_scale` must lie within the optimizer's [min_scale, max_scale]. Received: "
                             f"initial_scale={self.initial_scale!r}, with min_scale={optimizer.min_scale!r}, "
                             f"max_scale={optimizer.max_scale!r}.")
        run = _common.steps_run(optimizer)
        if run == 0:
            optimizer.dynamic_scale.assign(self.initial_scale)
            optimizer.current_growth_interval.assign(self.growth_interval)
            optimizer.good_steps.assign(0)
            optimizer.hysteresis_left.assign(optimizer.hysteresis)
            self.finished_at = None
            self._active = True
        elif self._in_progress(optimizer, run):
            self._active = True  # resumed from a checkpoint written during the warm-up
        else:
            return
        self._check_end()

    def on_train_batch_end(self, batch, logs=None):
        """Ends the warm-up at the first overflow or after `steps` steps."""
        if self._active:
            self._check_end()

    def _in_progress(self, optimizer, run):
        interval = _common.read(optimizer.current_growth_interval)
        return (interval == self.growth_interval != optimizer.growth_interval
                and _common.read(optimizer.skipped_steps) == 0 and run < self.steps)

    def _check_end(self):
        optimizer = self._optimizer
        run = _common.steps_run(optimizer)
        if _common.read(optimizer.skipped_steps) == 0 and run < self.steps:
            return
        # The optimizer grows once good_steps reaches the interval (>=), so a count
        # already past a shorter restored interval grows at the next finite step.
        optimizer.current_growth_interval.assign(optimizer.growth_interval)
        self._active = False
        self.finished_at = run

    def get_config(self):
        """The constructor arguments."""
        return {"initial_scale": self.initial_scale, "growth_interval": self.growth_interval, "steps": self.steps}

    @classmethod
    def from_config(cls, config):
        """Re-creates the callback from `get_config()`."""
        return cls(**config)
