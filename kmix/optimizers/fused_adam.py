"""Adam's and AdamW's update on TensorFlow's fused kernel, for the optimizers kmix wraps.

Keras writes Adam's update as a dozen element-wise operations per variable
(`m += (g - m) * (1 - beta_1)`, the same for `v` with `g ** 2`, then
`var -= m * alpha / (sqrt(v) + epsilon)`), each a pass over the variable's
size in memory. TensorFlow's `ResourceApplyAdam` kernel does the same
arithmetic, in the same order, in one pass (on CPUs, GPUs and under XLA).
The update is a fixed cost of every step whatever the compute dtype, so in a
bfloat16 step, whose matmuls run twice as fast, it is a larger share; and
behind `kmix.LossScaleOptimizer`, which applies only once every gradient is
known to be finite, it cannot overlap the backward pass. On the GPT of
`python -m kmix bench train` (a 2-core Xeon, bfloat16) the step is about 7%
faster with it (docs/benchmarks.md).

`install(optimizer)` gives an optimizer whose class is exactly
`keras.optimizers.Adam` or `AdamW` (a subclass may change the update) and
that does not use `amsgrad` the fused `update_step`. Variables that are not
float32 or float64 (kmix's `"kahan"` bfloat16 parameters) and sparse
gradients (`Embedding`'s `IndexedSlices`) keep Keras's update. Everything
around the update (weight decay, clipping, EMA, Keras's gradient
accumulation, the learning-rate schedule) stays Keras's, which calls
`update_step` per variable.
"""

import functools

import keras
import tensorflow as tf

from kmix._compat import adam_slots

_FUSED_DTYPES = (tf.float32, tf.float64)


def can_fuse(optimizer):
    """Whether `install` would fuse `optimizer`'s update: exact Adam / AdamW, no amsgrad."""
    return type(optimizer) in (keras.optimizers.Adam, keras.optimizers.AdamW) and not optimizer.amsgrad


def install(optimizer):
    """Makes `optimizer` apply its dense float32 / float64 updates with the fused kernel.

    Args:
        optimizer: any Keras optimizer; only those `can_fuse` accepts change.

    Returns:
        True when the fused update was installed (or already was), else False.

    Example:
        >>> opt = keras.optimizers.AdamW(1e-3)
        >>> install(opt)
        True
    """
    if not can_fuse(optimizer):
        return False
    # An instance attribute: Keras calls `self.update_step(...)` per variable, and the
    # user's object keeps its class, config and slots; only the arithmetic's kernel changes.
    if not isinstance(optimizer.__dict__.get("update_step"), functools.partial):
        optimizer.update_step = functools.partial(_fused_update_step, optimizer)
    return True


def remove(optimizer):
    """Gives `optimizer` back Keras's own `update_step`, if `install` replaced it."""
    if is_installed(optimizer):
        del optimizer.update_step


def is_installed(optimizer):
    """Whether `optimizer` updates with the fused kernel."""
    return isinstance(optimizer.__dict__.get("update_step"), functools.partial)


def _fused_update_step(optimizer, gradient, variable, learning_rate):
    """Keras's `Adam.update_step`, on `ResourceApplyAdam` where the kernel applies."""
    tf_variable = _tf_variable(variable)
    if isinstance(gradient, tf.IndexedSlices) or tf_variable.dtype not in _FUSED_DTYPES:
        return type(optimizer).update_step(optimizer, gradient, variable, learning_rate)
    dtype = tf_variable.dtype
    momentum, velocity = adam_slots(optimizer, variable)
    beta_1 = tf.cast(optimizer.beta_1, dtype)
    beta_2 = tf.cast(optimizer.beta_2, dtype)
    local_step = tf.cast(optimizer.iterations + 1, dtype)
    tf.raw_ops.ResourceApplyAdam(
        var=tf_variable.handle,
        m=_tf_variable(momentum).handle,
        v=_tf_variable(velocity).handle,
        beta1_power=tf.pow(beta_1, local_step),
        beta2_power=tf.pow(beta_2, local_step),
        lr=tf.cast(learning_rate, dtype),
        beta1=beta_1,
        beta2=beta_2,
        epsilon=tf.cast(optimizer.epsilon, dtype),
        grad=tf.cast(gradient, dtype),
        use_locking=False,
    )


def _tf_variable(variable):
    """The `tf.Variable` behind a Keras variable (Keras hands `update_step` either)."""
    return variable.value if isinstance(variable, keras.Variable) else variable
