"""`kmix.wrap(optimizer)`: the one call that makes an optimizer mixed-precision safe."""

import inspect
import logging

import keras
import tensorflow as tf

from kmix import _checks as checks
from kmix.optimizers.loss_scale import LossScaleOptimizer
from kmix.optimizers.scaling import AUTO

_log = logging.getLogger("kmix")


def wrap(optimizer, **kwargs):
    """Returns `optimizer` wrapped in a `kmix.LossScaleOptimizer` suited to the policy.

    Under a float16 policy the scale is dynamic, elsewhere `"auto"` (docs/guide.md); under
    `MultiWorkerMirroredStrategy` it also runs `kmix.distribute.enable_multi_worker_fit()` once.

    Args:
        optimizer: a Keras optimizer, a name (`"adam"`) or a config dict; a Keras `LossScaleOptimizer`
            (re-wrapped, its scale kept); a kmix one (returned as it is).
        **kwargs: arguments of `kmix.LossScaleOptimizer`; they override the defaults above.

    Returns:
        A `kmix.LossScaleOptimizer`.

    Example:
    >>> model.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(3e-4), hysteresis=2), loss="mse")
    """
    ours = [p for p in inspect.signature(LossScaleOptimizer.__init__).parameters
            if p not in ("self", "inner_optimizer", "kwargs")]
    unknown = sorted(set(kwargs) - set(ours) - set(inspect.signature(keras.optimizers.Optimizer.__init__).parameters))
    if unknown:  # Keras's base arguments (clipnorm, ...) get Keras's own message
        raise TypeError("`kmix.wrap` got unexpected keyword arguments. Received: "
                        + ", ".join(f"{k}={kwargs[k]!r}" for k in unknown)
                        + f". Accepted: {', '.join(ours)} (the arguments of kmix.LossScaleOptimizer).")
    if isinstance(tf.distribute.get_strategy(), tf.distribute.MultiWorkerMirroredStrategy):
        from kmix.distribute import enable_multi_worker_fit, multi_worker_fit_enabled
        if not multi_worker_fit_enabled():
            enable_multi_worker_fit()
            _log.info("kmix.wrap: under MultiWorkerMirroredStrategy; enabled kmix.distribute.enable_multi_worker_fit()")
    if isinstance(optimizer, LossScaleOptimizer):
        config = optimizer.get_config()
        conflicts = {k: v for k, v in kwargs.items() if k not in config or config[k] != v}
        if conflicts:
            raise ValueError(
                "`optimizer` is already a kmix.LossScaleOptimizer; it is returned unchanged, so keyword arguments "
                "must agree with its config. Received conflicting: "
                + ", ".join(f"{k}={v!r} (has {config.get(k, 'no such argument')!r})" for k, v in conflicts.items())
                + ". Create a new one with `kmix.LossScaleOptimizer(opt.inner_optimizer, ...)` instead.")
        return optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        scale = float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)) if optimizer.built else float(
            optimizer.initial_scale)
        return LossScaleOptimizer(optimizer.inner_optimizer, **{
            "initial_scale": scale, "growth_interval": optimizer.dynamic_growth_steps, **kwargs})
    float16 = keras.config.dtype_policy().compute_dtype == "float16"
    defaults = {"dynamic": True if float16 else AUTO, "initial_scale": AUTO}
    return LossScaleOptimizer(checks.optimizer(optimizer), **{**defaults, **kwargs})
