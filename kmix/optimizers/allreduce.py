"""Gradient all-reduce in float16 or bfloat16 (`allreduce_dtype`), checked on the sums.

    g = float32(g) * m                             # m: 1 for scaled gradients, the loss scale for unscaled ones
    w = 2^(14 - exponent(all_reduce_sum(max|g|)))  # float16 only: no partial sum overflows; 1 if not finite
    s = all_reduce_sum(half(g * w)) / w            # finite on every replica or on none
"""

import tensorflow as tf

ACCEPTED = ("float16", "bfloat16")
_DTYPES = {"float16": tf.float16, "bfloat16": tf.bfloat16}


def check_dtype(value):
    """`value` as `"float16"`, `"bfloat16"` or None; a `ValueError` naming `allreduce_dtype` otherwise."""
    if value is None:
        return None
    name = getattr(value, "name", value)  # tf.float16, np.dtype("float16")
    if isinstance(name, str) and name in ACCEPTED:
        return name
    raise ValueError("`allreduce_dtype` must be 'float16', 'bfloat16' or None (gradients reduced in their own dtype, "
                     f"float32 for float32 variables). Received: allreduce_dtype={value!r}")


def reduces_here(allreduce_dtype, replica_context):
    """Whether kmix all-reduces in `allreduce_dtype` here: a half dtype and more than one replica."""
    return allreduce_dtype is not None and replica_context.num_replicas_in_sync > 1


def all_reduce(grads, variables, allreduce_dtype, multiplier=None, poison=None):
    """The float32 sums over every replica of `grads` (None, tensors or `tf.IndexedSlices`), reduced in half.

    Args:
        multiplier: a float32 scalar (the loss scale, for unscaled gradients), or None.
        poison: None, or a boolean per gradient: True sends NaN (an overflow earlier in this replica's window).
    """
    dtype = _DTYPES[allreduce_dtype]
    indices = [i for i, (g, v) in enumerate(zip(grads, variables))
               if g is not None and not getattr(v, "overwrite_with_gradient", False)]
    if not indices:
        return list(grads)
    ctx = tf.distribute.get_replica_context()
    m = None if multiplier is None else tf.cast(multiplier, tf.float32)
    times = (lambda x: tf.cast(x, tf.float32)) if m is None else (lambda x: tf.cast(x, tf.float32) * m)
    values = [map_values(grads[i], times) for i in indices]
    wire = [None] * len(values)
    if dtype == tf.float16:
        peaks = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack([_peak(values_of(v)) for v in values]))
        wire = tf.unstack(wire_scales(peaks))
    sent = [map_values(v, lambda x, w=w, bad=None if poison is None else poison[i]: _to_half(x, dtype, w, bad))
            for i, v, w in zip(indices, values, wire)]
    sums = ctx.all_reduce(tf.distribute.ReduceOp.SUM, sent)
    out = list(grads)
    for i, s, w in zip(indices, sums, wire):
        out[i] = map_values(s, lambda x, w=w: tf.cast(x, tf.float32) if w is None else tf.cast(x, tf.float32) / w)
    return out


def wire_scales(bounds):
    """Per bound `b`, the power of two `w` with `b * w` in [2^14, 2^15), from `b`'s bits (exact), within
    [2^-120, 2^120]; 1 where `b` is not finite."""
    bits = tf.bitcast(tf.cast(bounds, tf.float32), tf.int32)
    exponent = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 23), 0xFF) - 127  # floor(log2 b)
    shift = tf.clip_by_value(14 - exponent, -120, 120)
    scale = tf.bitcast(tf.bitwise.left_shift(shift + 127, 23), tf.float32)  # 2^shift, exactly
    return tf.where(tf.math.is_finite(bounds), scale, tf.ones_like(scale))


def values_of(g):
    """A gradient's values: `g.values` for `tf.IndexedSlices`, else `g`."""
    return g.values if isinstance(g, tf.IndexedSlices) else g


def map_values(g, fn):
    """`fn` applied to a gradient's values, `tf.IndexedSlices` kept sparse."""
    return tf.IndexedSlices(fn(g.values), g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices) else fn(g)


def _to_half(x, dtype, wire, bad):
    x = x if wire is None else x * wire
    return tf.cast(x if bad is None else tf.where(bad, tf.fill(tf.shape(x), float("nan")), x), dtype)


def _peak(x):
    """max |x|, 0 for an empty tensor; two reductions that write nothing (`abs` would write a copy of x)."""
    return tf.maximum(tf.maximum(tf.reduce_max(x), -tf.reduce_min(x)), 0.0)
