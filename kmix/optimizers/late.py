"""A late `kmix.autocast`: a model compiled before it was placed in float16 may train unscaled.

Keras wraps an optimizer in a `LossScaleOptimizer` only when `compile` runs
under `mixed_float16`, and `kmix.wrap` outside a float16 scope gives a fixed
scale of 1, which becomes dynamic only if the optimizer is built after the
model computes in float16. A model compiled earlier and placed in float16
afterwards by `kmix.autocast` then trains with no loss scaling: small
gradients flush to zero, silently. `warn_if_unscaled` says so, once, and
how to recompile.
"""

import warnings

import keras

from kmix.optimizers.loss_scale import LossScaleOptimizer
from kmix.policy import Policy


def unscaled_reason(optimizer):
    """Why `optimizer` will not scale the loss, or None when it will (or will decide when built).

    Args:
        optimizer: the model's optimizer (`model.optimizer`).

    Returns:
        A phrase naming the optimizer and why, or None.
    """
    if optimizer is None:
        return None
    if isinstance(optimizer, LossScaleOptimizer):
        # Unbuilt, `build` follows the model: a scale `kmix.wrap` chose turns dynamic where layers
        # compute in float16, and a fixed scale of 1 the caller asked for warns there.
        if optimizer.dynamic or not optimizer.built or float(optimizer.loss_scale) != 1.0:
            return None
        return (f"kmix.LossScaleOptimizer {optimizer.name!r}, built with a fixed loss scale of 1 "
                "(wrapped outside a float16 policy, or with dynamic=False)")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None  # Keras's own: always dynamic
    return (f"a plain {type(optimizer).__name__} (Keras adds loss scaling only when `compile` runs "
            "under mixed_float16)")


def warn_if_unscaled(model, policy):
    """Warns once when `model` will compute in float16 but its optimizer will not scale the loss.

    `kmix.autocast` calls it at its end. Nothing is said for a policy
    without float16 compute, a model that is not compiled, or an optimizer
    that scales: Keras's `LossScaleOptimizer`, a `kmix.LossScaleOptimizer`
    with a dynamic scale or a fixed one other than 1, or an unbuilt one
    (its `build` follows the model's float16 layers).

    Args:
        model: the `keras.Model` that was placed.
        policy: the policy it was placed under, anything `kmix.Policy` accepts.

    Returns:
        True if it warned, else False.

    Example:

    >>> model.compile(optimizer="adam", loss="mse")      # compiled in float32
    >>> kmix.autocast(model, "O1")                       # warns: recompile with kmix.wrap
    >>> with kmix.policy_scope("O1"):
    ...     model.compile(optimizer=kmix.wrap(keras.optimizers.Adam()), loss="mse")
    """
    policy = Policy(policy)
    if policy.compute_dtype != "float16" or not getattr(model, "compiled", False):
        return False
    optimizer = getattr(model, "optimizer", None)
    reason = unscaled_reason(optimizer)
    if reason is None:
        return False
    inner = type(getattr(optimizer, "inner_optimizer", optimizer)).__name__
    inner = f"keras.optimizers.{inner}" if getattr(keras.optimizers, inner, None) is not None else inner
    warnings.warn(
        f"Model {model.name!r} now computes in float16 ({policy.name}) but was compiled with {reason}: "
        "it will train with no loss scaling, so small float16 gradients flush to zero. Recompile it "
        f"inside the policy's scope: `with kmix.policy_scope({policy.name!r}): model.compile("
        f"optimizer=kmix.wrap({inner}(...)), loss=...)`.",
        UserWarning,
        stacklevel=3,
    )
    return True
