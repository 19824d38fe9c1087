"""`kmix.wrap(optimizer)`: the one call that makes an optimizer mixed-precision safe."""

import logging

import keras
import tensorflow as tf

from kmix.optimizers.loss_scale import LossScaleOptimizer

_log = logging.getLogger("kmix")


def wrap(optimizer, **kwargs):
    """Returns `optimizer` wrapped in a `kmix.LossScaleOptimizer` suited to the policy.

    Under a float16 compute policy the loss scale is dynamic (Keras's and
    torch's defaults: 2^15, x2 every 2000 finite steps, /2 on overflow). Under
    bfloat16 or float32, which need no loss scaling, the scale is fixed at 1
    (`dynamic=False, initial_scale=1`) and non-finite steps are still skipped,
    so one bad batch never corrupts the weights. With
    `allreduce_dtype="float16"` the scale is dynamic under any policy: the
    scaled gradients are summed in float16, whose range the scale must fit.

    Args:
        optimizer: a Keras optimizer instance, a name (`"adam"`) or a config
            dict, as `keras.optimizers.get` accepts; or a Keras
            `LossScaleOptimizer`, whose inner optimizer is re-wrapped and whose
            current scale is kept; or a kmix optimizer, returned as it is.
        **kwargs: arguments of `kmix.LossScaleOptimizer`; they override the
            policy's defaults.

    Called inside a `tf.distribute.MultiWorkerMirroredStrategy` scope, it also
    runs `kmix.distribute.enable_multi_worker_fit()` (once), without which
    Keras 3.15's `fit` fails under that strategy.

    Returns:
        A `kmix.LossScaleOptimizer`.

    Example:

    >>> model.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(3e-4)), loss="mse")
    >>> kmix.wrap("adam", hysteresis=2)
    >>> kmix.wrap("adam", allreduce_dtype="float16")  # gradients summed in float16 across replicas
    """
    _enable_multi_worker_fit_in_scope()
    if isinstance(optimizer, LossScaleOptimizer):
        config = optimizer.get_config()
        conflicts = {k: v for k, v in kwargs.items() if k not in config or config[k] != v}
        if conflicts:
            raise ValueError(
                "`optimizer` is already a kmix.LossScaleOptimizer; it is returned unchanged, so "
                "keyword arguments must agree with its config. Received conflicting: "
                + ", ".join(f"{k}={v!r} (has {config.get(k, 'no such argument')!r})" for k, v in conflicts.items())
                + ". Create a new one with `kmix.LossScaleOptimizer(opt.inner_optimizer, ...)` instead."
            )
        return optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        defaults = {
            "initial_scale": float(keras.ops.convert_to_numpy(optimizer.dynamic_scale))
            if optimizer.built
            else float(optimizer.initial_scale),
            "growth_interval": optimizer.dynamic_growth_steps,
        }
        return LossScaleOptimizer(optimizer.inner_optimizer, **{**defaults, **kwargs})
    inner = _get_optimizer(optimizer)
    compute = keras.config.dtype_policy().compute_dtype
    # float16 computing or float16 all-reduce (whose range the scale must use) wants a dynamic scale.
    half_range = compute == "float16" or kwargs.get("allreduce_dtype") == "float16"
    defaults = {} if half_range else {"dynamic": False, "initial_scale": 1.0}
    if kwargs.get("dynamic", defaults.get("dynamic", True)) is False and "min_scale" not in kwargs:
        defaults["min_scale"] = min(1.0, kwargs.get("initial_scale", 1.0))
    wrapped = LossScaleOptimizer(inner, **{**defaults, **kwargs})
    # A fixed scale chosen here from the policy, not by the caller: `build` may switch it to
    # dynamic when the model's layers compute in float16 (kmix/optimizers/follow_model.py).
    wrapped._scale_from_policy = "dynamic" in defaults and not {"dynamic", "initial_scale"} & set(kwargs)
    # No scale asked for: `build` may start from the one `kmix.autocast(..., sample=)` advised.
    wrapped._initial_scale_from_wrap = "initial_scale" not in kwargs
    return wrapped


def _get_optimizer(optimizer):
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer
    if isinstance(optimizer, (str, dict)):
        try:
            return keras.optimizers.get(optimizer)
        except ValueError as e:
            raise ValueError(
                f"`optimizer` could not be interpreted as a Keras optimizer. Received: "
                f"optimizer={optimizer!r}. Expected an optimizer instance, a name such as "
                f"'adam' or a config dict. ({e})"
            ) from None
    raise TypeError(
        "`optimizer` must be a keras.optimizers.Optimizer instance, a name such as 'adam', or "
        f"a config dict. Received: optimizer={optimizer!r} (of type {type(optimizer).__name__})."
    )


def _enable_multi_worker_fit_in_scope():
    from kmix.distribute import enable_multi_worker_fit, multi_worker_fit_enabled

    in_scope = isinstance(tf.distribute.get_strategy(), tf.distribute.MultiWorkerMirroredStrategy)
    if in_scope and not multi_worker_fit_enabled():
        enable_multi_worker_fit()
        _log.info("kmix.wrap: under MultiWorkerMirroredStrategy; enabled kmix.distribute.enable_multi_worker_fit().")
