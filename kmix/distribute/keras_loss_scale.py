"""Keras's own `LossScaleOptimizer` under a strategy: one overflow decision for all replicas.

Keras 3.15 decides a step is finite from the first local replica's gradients only: under `MirroredStrategy`
an inf elsewhere reaches the weights, and under `MultiWorkerMirroredStrategy` the workers part ways and hang.
The wrapped `apply` all-reduces a "non-finite" flag and, where any replica overflowed, makes every replica's
gradients non-finite, so every replica skips; finite steps pass unchanged.
"""

import tensorflow as tf

from kmix import _compat

_state = {"keras_apply": None}


def _any_nonfinite(grads):
    flags = [
        tf.reduce_any(tf.logical_not(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g)))
        for g in grads
        if g is not None
    ]
    return tf.cast(tf.reduce_any(tf.stack(flags)), tf.float32) if flags else tf.constant(0.0)


def _poison(g, overflow):
    if g is None:
        return None
    values = g.values if isinstance(g, tf.IndexedSlices) else g
    values = tf.where(overflow, tf.constant(float("nan"), values.dtype), values)
    return tf.IndexedSlices(values, g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices) else values


def _make_apply(keras_apply):
    def apply(self, grads, trainable_variables=None):
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            grads = list(grads)
            overflow = ctx.all_reduce(tf.distribute.ReduceOp.SUM, _any_nonfinite(grads)) > 0
            grads = [_poison(g, overflow) for g in grads]
        return keras_apply(self, grads, trainable_variables)

    apply.__doc__ = keras_apply.__doc__
    apply.kmix_replaces = keras_apply
    return apply


def install():
    """Wraps `keras.optimizers.LossScaleOptimizer.apply` (and so its subclasses'); idempotent."""
    if _state["keras_apply"] is None:
        _state["keras_apply"] = _compat.keras_loss_scale_apply()
        _compat.set_keras_loss_scale_apply(_make_apply(_state["keras_apply"]))


def uninstall():
    """Puts Keras's own `apply` back."""
    if _state["keras_apply"] is not None:
        _compat.set_keras_loss_scale_apply(_state["keras_apply"])
        _state["keras_apply"] = None
