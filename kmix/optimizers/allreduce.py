"""Gradient all-reduce in float16 or bfloat16 (`allreduce_dtype`), checked on the sums.

What Apex, DeepSpeed and Megatron-LM do, and torch DDP's
`fp16_compress_hook` / Horovod's `Compression.fp16`: the gradients cross the
wire in half precision, half the bytes of float32. kmix reduces them itself,
in `kmix.LossScaleOptimizer.apply`, and the inner optimizer takes the sums
as they are (`kmix._compat.take_gradients_as_reduced`):

    g_half = half(g * m)            # m = 1 for scaled gradients, the scale for unscaled ones
    s = all_reduce(SUM, g_half)     # in half precision, over every replica of every worker
    finite = all(isfinite(s))       # the same on every replica: no flag all-reduce
    update with float32(s) / scale  # unscaled in float32, or skipped everywhere

- float16: the *scaled* gradients are reduced, so float16's range is used
  (loss scaling keeps small gradients above 2^-24). An overflow of one
  replica's gradient (above 65504 in the cast) or one that appears only in
  the sum is an inf in the sum on every replica: the step is skipped
  everywhere and the dynamic scale backs off.
- bfloat16: float32's range; no dynamic scale is needed (`kmix.wrap` keeps a
  fixed scale of 1 outside float16 policies). 8 significant bits.
- Averaging: Keras's `fit` divides each replica's loss by the number of
  replicas (`compile`'s loss), and custom loops do with
  `tf.nn.compute_average_loss(..., global_batch_size=...)`: each replica's
  gradient is already its share of the mean (the pre-divide of DDP's and
  Horovod's compression), so the sum is the mean and never exceeds the
  largest replica's share times the number of replicas. No other division.
- No strategy, or one replica: nothing to reduce; `allreduce_dtype` does
  nothing (the gradients stay as they are).
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
    raise ValueError(
        "`allreduce_dtype` must be 'float16', 'bfloat16' or None (gradients reduced in their "
        f"own dtype, float32 for float32 variables). Received: allreduce_dtype={value!r}"
    )


def reduces_here(allreduce_dtype, replica_context):
    """Whether kmix all-reduces in `allreduce_dtype` here: a half dtype and more than one replica."""
    return allreduce_dtype is not None and replica_context.num_replicas_in_sync > 1


def all_reduce(grads, variables, allreduce_dtype, multiplier=None, poison=None):
    """Sums the gradients over every replica in `allreduce_dtype`; returns the sums in float32.

    Args:
        grads: one gradient (tensor, `tf.IndexedSlices` or None) per variable.
        variables: the variables, for their `overwrite_with_gradient` flag
            (such gradients are not reduced, as in Keras).
        allreduce_dtype: `"float16"` or `"bfloat16"`.
        multiplier: a float32 scalar the gradients are multiplied by before
            the cast (the loss scale, for unscaled gradients), or None.
        poison: a boolean per gradient, or None: where True this replica
            sends NaN instead, so every replica sees that variable's sum
            non-finite (an overflow this replica found in an earlier
            micro-batch of an accumulation window).

    Returns:
        A list like `grads`: float32 sums (None and overwritten ones as given).
    """
    dtype = _DTYPES[allreduce_dtype]
    indices = [
        i for i, (g, v) in enumerate(zip(grads, variables))
        if g is not None and not getattr(v, "overwrite_with_gradient", False)
    ]
    if not indices:
        return list(grads)
    sent = []
    for i in indices:
        g = grads[i]
        bad = None if poison is None else poison[i]
        sent.append(_map_values(g, lambda x, bad=bad: _to_half(x, dtype, multiplier, bad)))
    sums = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, sent)
    out = list(grads)
    for i, s in zip(indices, sums):
        out[i] = _map_values(s, lambda x: tf.cast(x, tf.float32))
    return out


def bytes_per_step(variables, allreduce_dtype):
    """Bytes one replica sends into the all-reduce per step (the gradients' sizes in that dtype)."""
    total = 0
    for v in variables:
        size = 1
        for d in v.shape:
            size *= int(d)
        width = tf.as_dtype(allreduce_dtype).size if allreduce_dtype else tf.as_dtype(_dtype_name(v)).size
        total += size * width
    return total


def _dtype_name(v):
    dtype = v.dtype
    return getattr(dtype, "name", dtype)


def _to_half(x, dtype, multiplier, bad):
    x = tf.cast(x, tf.float32)
    if multiplier is not None:
        x = x * tf.cast(multiplier, tf.float32)
    if bad is not None:
        x = tf.where(bad, tf.fill(tf.shape(x), float("nan")), x)
    return tf.cast(x, dtype)


def _map_values(g, fn):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(fn(g.values), g.indices, g.dense_shape)
    return fn(g)
