"""Helpers shared by kmix's callbacks: finding the optimizers, reading scalars, checks."""

import keras
import numpy as np

from kmix import _compat
from kmix.optimizers import LossScaleOptimizer


def model_optimizer(model, caller):
    """`model.optimizer`, or a clear error when the model is not compiled."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(f"{caller} needs a compiled model; received a model with no optimizer. "
                         "Call `model.compile(optimizer=...)` before `model.fit`.")
    return optimizer


def loss_scale_optimizer(model, caller):
    """`model.optimizer` if it is a `kmix.LossScaleOptimizer`; raises otherwise."""
    optimizer = model_optimizer(model, caller)
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer
    hint = ("Keras's own LossScaleOptimizer has no skip counter nor adjustable growth interval; compile with "
            "`optimizer=kmix.wrap(opt)` instead (a float16 policy makes Keras wrap the optimizer by itself)."
            if isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            else "Compile with `optimizer=kmix.wrap(opt)`.")
    raise ValueError(f"{caller} needs a kmix.LossScaleOptimizer as the model's optimizer. Received: "
                     f"model.optimizer={type(optimizer).__name__}. {hint}")


def build_optimizer(model):
    """Builds `model.optimizer` on a built model's trainable variables (Keras builds it in the first step,
    after `on_train_begin`); returns whether it is built now."""
    optimizer = model.optimizer
    if not optimizer.built and model.built:
        optimizer.build(model.trainable_variables)
    return optimizer.built


def holder_of_learning_rate(optimizer):
    """The optimizer object whose `learning_rate` is the real one (the inner one if wrapped)."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def learning_rate_of(optimizer):
    """The learning-rate object itself (a `keras.Variable`, a schedule or a callable)."""
    return _compat.learning_rate_object(holder_of_learning_rate(optimizer))


def set_learning_rate(optimizer, value):
    """Sets the learning rate of `optimizer` (of the inner optimizer if wrapped)."""
    holder_of_learning_rate(optimizer).learning_rate = value


def read(variable):
    """A Python number from a scalar variable or tensor (one device-to-host copy)."""
    return np.asarray(to_numpy(variable)).item()


def to_numpy(value):
    """A numpy copy of a variable or eager tensor (`.numpy()`: no numpy-2 copy warning)."""
    if hasattr(value, "numpy"):
        return np.array(value.numpy(), copy=True)
    return np.array(keras.ops.convert_to_numpy(value), copy=True)


def steps_run(optimizer):
    """Steps the loss-scale optimizer has seen: applied (`iterations`) + skipped."""
    return read(optimizer.iterations) + read(optimizer.skipped_steps)


def retrace(model):
    """Makes `model.fit` trace its train step again: a traced step has the old learning-rate schedule baked in."""
    if getattr(model, "train_function", None) is not None:
        model.make_train_function(force=True)
