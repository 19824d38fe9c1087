"""`kmix.wrap(optimizer)`: the one call that makes an optimizer mixed-precision safe."""

import inspect
import logging

import keras
import tensorflow as tf

from kmix import _checks as checks
from kmix.optimizers import follow_model
from kmix.optimizers.loss_scale import LossScaleOptimizer

_log = logging.getLogger("kmix")


def wrap(optimizer, **kwargs):
    """Returns `optimizer` wrapped in a `kmix.LossScaleOptimizer` suited to the policy.

    Under a float16 compute policy the loss scale is dynamic (Keras's and
    torch's defaults: 2^15, x2 every 2000 finite steps, /2 on overflow). Under
    bfloat16 or float32, which need no loss scaling, the scale is fixed at 1
    (`dynamic=False, initial_scale=1`) and non-finite steps are still skipped,
    so one bad batch never corrupts the weights. What the caller does not
    give is still the policy's to choose when the optimizer is built: a model
    whose layers compute in float16 gets a dynamic scale (from the scale the
    caller gave, the one `kmix.autocast(..., sample=)` advised, or 2^15), and
    `dynamic=True` alone starts from the advised scale or 2^15.

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
    >>> kmix.wrap("adam", dynamic=True)  # dynamic scaling from 2^15 (or the advised scale) under any policy
    """
    _check_keywords(kwargs)
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
    defaults = {}
    if keras.config.dtype_policy().compute_dtype != "float16":
        defaults["dynamic"] = False
        if not kwargs.get("dynamic", False):  # `dynamic=True` alone starts where a dynamic scale does
            defaults["initial_scale"] = 1.0
    if kwargs.get("dynamic", defaults.get("dynamic", True)) is False and "min_scale" not in kwargs:
        # Checked here first: the floor is computed from it before the constructor's checks run.
        initial = checks.real("initial_scale", kwargs.get("initial_scale", 1.0), low=0.0, low_open=True)
        defaults["min_scale"] = min(1.0, initial)
    wrapped = LossScaleOptimizer(inner, **{**defaults, **kwargs})
    # What the caller left to the policy, which `build` may revisit once it knows the model
    # (kmix/optimizers/follow_model.py): a fixed scale becomes dynamic where layers compute in
    # float16, and a scale wrap chose starts from the one kmix.autocast(..., sample=) advised.
    wrapped._dynamic_from_policy = "dynamic" in defaults and "dynamic" not in kwargs
    wrapped._initial_scale_from_wrap = "initial_scale" not in kwargs
    wrapped._policy_name = follow_model.active_policy_name()
    return wrapped


def _check_keywords(kwargs):
    """A `TypeError` naming keyword arguments that neither kmix's nor Keras's optimizer takes."""
    ours = [p for p in inspect.signature(LossScaleOptimizer.__init__).parameters
            if p not in ("self", "inner_optimizer", "kwargs")]
    # Keras's base arguments (clipnorm, weight_decay, ...) get Keras's own message: set them on the inner optimizer.
    known = set(ours) | set(inspect.signature(keras.optimizers.Optimizer.__init__).parameters)
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        raise TypeError(
            f"`kmix.wrap` got unexpected keyword arguments. Received: "
            + ", ".join(f"{k}={kwargs[k]!r}" for k in unknown)
            + f". Accepted: {', '.join(ours)} (the arguments of kmix.LossScaleOptimizer)."
        )


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
