"""What `autocast` leaves on a model beside its placement: a checkpoint record of its level, a warning.

The record makes a `tf.train.Checkpoint` read whose model weights differ in
dtype raise naming both levels before any value is read; the warning says
when the optimizer the model was compiled with will not scale a float16 loss.
"""

import warnings

import keras

from kmix import _compat
from kmix.optimizers import LossScaleOptimizer, saved_level

MODEL_RECORD_NAME = "kmix_level"  # the model's dependency in a checkpoint


def record_model_level(model):
    """Makes `model`'s checkpoints carry its opt level and weight dtypes (also read before the optimizer is built)."""

    def layout():
        return saved_level.Layout.of(model.weights, "model", False)

    def describe(layout):
        params = " and ".join(f"{n} {dtype}" for dtype, n in layout.params) or "no"
        return f"{layout.level} ({params} weights)"

    def check(saved_text):
        saved, _ = saved_level.Layout.decode(saved_text)
        here = layout()
        if saved is not None and saved.params != here.params:
            raise ValueError(
                f"This tf.train.Checkpoint was written from a model at {describe(saved)}; this model is at "
                f"{describe(here)}. A checkpoint restores each value as saved into the object in its place, and "
                f"the weights differ in dtype. Nothing was restored. To convert it, restore it into the model "
                f"placed at {saved.level} with its optimizer, write model.save_weights('converted.weights.h5'), "
                "and load_weights that file here: weights files convert between opt levels.")

    label = f"kmix's record of the model's opt level ({MODEL_RECORD_NAME})"
    _compat.attach_record(model, MODEL_RECORD_NAME, _compat.NamedMark(lambda: layout().encode(), check, label))


def unscaled_reason(optimizer):
    """Why `optimizer` will not scale the loss, or None when it will (or decides when built)."""
    if optimizer is None or isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and not isinstance(
            optimizer, LossScaleOptimizer):
        return None  # Keras's own is always dynamic
    if isinstance(optimizer, LossScaleOptimizer):
        if optimizer.dynamic or not optimizer.built or float(optimizer.loss_scale) != 1.0:
            return None
        return (f"kmix.LossScaleOptimizer {optimizer.name!r}, built with a fixed loss scale of 1 (wrapped outside "
                "a float16 policy, or with dynamic=False)")
    return (f"a plain {type(optimizer).__name__} (Keras adds loss scaling only when `compile` runs under "
            "mixed_float16)")


def warn_if_unscaled(model, policy):
    """Warns once when `model` computes in float16 (`policy`) but its optimizer will not scale the loss.

    `kmix.autocast` calls it at its end, for a model compiled before it was placed.

    Returns:
        True if it warned.
    """
    if policy.compute_dtype != "float16" or not getattr(model, "compiled", False):
        return False
    optimizer = getattr(model, "optimizer", None)
    reason = unscaled_reason(optimizer)
    if reason is None:
        return False
    inner = type(getattr(optimizer, "inner_optimizer", optimizer)).__name__
    inner = f"keras.optimizers.{inner}" if getattr(keras.optimizers, inner, None) is not None else inner
    warnings.warn(
        f"Model {model.name!r} now computes in float16 ({policy.name}) but was compiled with {reason}: it will "
        "train with no loss scaling, so small float16 gradients flush to zero. Recompile it inside the policy's "
        f"scope: `with kmix.policy_scope({policy.name!r}): model.compile(optimizer=kmix.wrap({inner}(...)), "
        "loss=...)`.", UserWarning, stacklevel=3)
    return True

