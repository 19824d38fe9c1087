"""Softmax and log-softmax that compute in float32 and select masked positions out.

The logits are cast to float32 (float64 stays float64) and a masked position is replaced with `where`,
never added to or multiplied by an infinity: its value and gradient are exactly zero, and a row with nothing
kept gives zeros. The arguments are checked in `kmix.ops.arguments`.
"""

import keras
import numpy as np
import tensorflow as tf

from kmix.ops.arguments import align_to_logits, keep_from_mask, normalize_axis, output_dtype, warn_if_keep_mask

# An additive bias at or below this masks its position, as `-inf` does (exp(-1e3) is 0 even in float64);
# -1e3 rather than -1e4 because BERT's -1e4 rounds to -9984 in bfloat16.
BIAS_MASK_THRESHOLD = -1e3


def masked_softmax(logits, mask=None, bias=None, axis=-1, dtype=None):
    """Softmax in float32 that zeroes masked positions and never gives NaN.

    A position is masked where `mask` is False (or <= 0.5), where `bias` is <= -1e3 (-1e9, `-inf`), or
    where its logit is `-inf`. `mask` keeps where True, as in Keras (pass torch's `key_padding_mask` as
    its `logical_not`); a numeric mask outside [0, 1] (an additive bias given as `mask`) raises, or, under
    XLA, makes the output NaN. A mask or bias of lower rank is a `(B, S)` key mask or a `(T, S)` one shared
    over the batch (`kmix.ops.arguments.align_to_logits`); one that could be either raises.

    Args:
        logits: a float tensor (float16, bfloat16, float32 or float64).
        mask: optional bool, or numeric with values in [0, 1], broadcastable to `logits`.
        bias: optional additive float bias broadcastable to `logits`: 0 keeps, values <= -1e3 mask.
        axis: an int or a tuple of ints: the axes normalised over.
        dtype: the output dtype; `logits.dtype` by default.

    Returns:
        A tensor of `logits`'s shape and `dtype`, summing to 1 over `axis` on every row that keeps a position.

    Example:
        >>> x = np.array([[1.0, 2.0, 3.0]], "float16")
        >>> kmix.ops.masked_softmax(x, mask=[[True, True, False]], dtype="float32")
        <tf.Tensor: shape=(1, 3), dtype=float32,
                    numpy=array([[0.26894143, 0.7310586 , 0.        ]], dtype=float32)>
    """
    return _masked_softmax(logits, mask, bias, axis, dtype, log=False)


def masked_log_softmax(logits, mask=None, bias=None, axis=-1, dtype=None):
    """Log-softmax in float32 for losses over masked positions; never NaN.

    Same arguments and masking rule as `masked_softmax`. A masked position holds 0 (not `-inf`, so
    `labels * log_probs` stays finite) with a zero gradient.

    Args:
        logits: a float tensor (float16, bfloat16, float32 or float64).
        mask: optional bool, or numeric with values in [0, 1], broadcastable to `logits`.
        bias: optional additive float bias broadcastable to `logits`: 0 keeps, values <= -1e3 mask.
        axis: an int or a tuple of ints: the axes normalised over.
        dtype: the output dtype; `logits.dtype` by default.

    Returns:
        A tensor of `logits`'s shape and dtype: `log(softmax)` at kept positions, 0 at masked ones.

    Example:
        >>> x = np.array([[0.0, 0.0, 5.0]], "float16")
        >>> kmix.ops.masked_log_softmax(x, bias=[[0.0, 0.0, -1e9]], dtype="float32")
        <tf.Tensor: shape=(1, 3), dtype=float32,
                    numpy=array([[-0.6931472, -0.6931472,  0.       ]], dtype=float32)>
    """
    return _masked_softmax(logits, mask, bias, axis, dtype, log=True)


def _masked_softmax(logits, mask, bias, axis, dtype, log, names=None, infinite_logits=True):
    """The shared body; `names` renames the arguments in messages. `infinite_logits=False` is the caller's word
    that no logit is `-inf`: rows with nothing kept are then found from the mask alone (two passes fewer)."""
    names = {"logits": "logits", "mask": "mask", "bias": "bias", **(names or {})}
    for name, value in (("logits", logits), ("mask", mask), ("bias", bias)):
        if keras.backend.is_keras_tensor(value):
            raise TypeError(f"`kmix.ops.masked_softmax` takes concrete tensors; `{names[name]}` is a symbolic "
                            "KerasTensor. In a functional model use the layer `kmix.layers.MaskedSoftmax` instead.")
    logits = tf.convert_to_tensor(logits)
    if not (logits.dtype.is_floating or logits.dtype.is_integer):
        raise TypeError(f"Received: {names['logits']}.dtype={logits.dtype.name}; expected a float tensor "
                        "(float16, bfloat16, float32 or float64).")
    out_dtype = output_dtype(logits.dtype, dtype)
    compute_dtype = tf.float64 if tf.float64 in (logits.dtype, out_dtype) else tf.float32
    rank = logits.shape.rank
    if rank is None or rank == 0:
        raise ValueError(f"`{names['logits']}` must have a known rank of at least 1 (a softmax normalises over an "
                         f"axis). Received: {names['logits']}.shape={logits.shape}.")
    axes = normalize_axis(axis, rank, names["logits"])
    x = tf.cast(logits, compute_dtype)

    keep = mask_ok = None
    if mask is not None:
        mask = align_to_logits(tf.convert_to_tensor(mask), logits.shape, names["mask"], names["logits"])
        keep, mask_ok = keep_from_mask(mask, names)
    if bias is not None:
        bias = tf.convert_to_tensor(bias)
        if not (bias.dtype.is_floating or bias.dtype.is_integer):
            hint = f" Pass a boolean mask as `{names['mask']}`." if bias.dtype == tf.bool else ""
            raise TypeError(f"Received: {names['bias']}.dtype={bias.dtype.name}; expected a float dtype (0 keeps, "
                            f"large negatives mask).{hint}")
        bias = align_to_logits(bias, logits.shape, names["bias"], names["logits"])
        warn_if_keep_mask(bias, names)
        bias = tf.cast(bias, compute_dtype)
        # `not (bias <= t)` rather than `bias > t`: a NaN bias stays NaN in the
        # result instead of silently masking the position.
        keep_bias = tf.logical_not(bias <= BIAS_MASK_THRESHOLD)
        x = x + tf.where(keep_bias, bias, tf.zeros([], compute_dtype))
        keep = keep_bias if keep is None else tf.logical_and(keep, keep_bias)
    if log:
        # A -inf logit is a mask too: log-softmax gives 0 there, not -inf.
        finite_below = tf.not_equal(x, tf.constant(-np.inf, compute_dtype))
        keep = finite_below if keep is None else tf.logical_and(keep, finite_below)

    if not log and len(axes) == 1:
        if infinite_logits:
            result = tf.cast(_fused_softmax(x, keep, axes[0]), out_dtype)
        else:
            result = _softmax_rows_from_mask(x, keep, axes[0], out_dtype)
        if mask_ok is not None:
            result = tf.where(mask_ok, result, tf.constant(np.nan, out_dtype))
        return result
    zero = tf.zeros([], compute_dtype)
    if keep is not None:
        # One select does both jobs: the max ignores masked positions, and exp(-inf - max)
        # is exactly 0 there, forward and backward (exp' = exp = 0, never 0 * inf).
        x = tf.where(keep, x, tf.constant(-np.inf, compute_dtype))
    row_max = tf.reduce_max(x, axis=axes, keepdims=True)
    # A row of -inf (or with nothing kept) has no finite max: shift by 0.
    row_max = tf.stop_gradient(tf.where(tf.math.is_finite(row_max), row_max, zero))
    shifted = x - row_max
    exps = tf.exp(shifted)
    total = tf.reduce_sum(exps, axis=axes, keepdims=True)
    if log:
        # `total` is >= 1 on a row that keeps a finite logit (its max gives
        # exp(0)); a row with nothing kept has total 0 and is zeroed by `keep`.
        safe_total = tf.where(total > zero, total, tf.ones([], compute_dtype))
        result = tf.where(keep, shifted - tf.math.log(safe_total), zero)
    else:
        # One reciprocal per row and a multiply per element: cheaper than dividing every
        # element (divide_no_nan); a row with nothing kept has total 0 and gives 0.
        result = exps * tf.math.reciprocal_no_nan(total)
    if mask_ok is not None:
        # Under XLA the assertion is dropped: a NaN output makes the bad mask visible.
        result = tf.where(mask_ok, result, tf.constant(np.nan, compute_dtype))
    return tf.cast(result, out_dtype)


def _fused_softmax(x, keep, axis):
    """The softmax over one axis on TensorFlow's fused kernel, masked positions selected out.

    Masked positions and `-inf` logits become the dtype's lowest finite value (a row of `-inf` would be NaN);
    a row whose max is that value is replaced with zeros. NaN stays NaN. The gradient is TensorFlow's own,
    through the selects: no `tf.custom_gradient`, which would keep every traced graph alive for the process.
    """
    lowest = tf.constant(x.dtype.min, x.dtype)
    logits = x if keep is None else tf.where(keep, x, lowest)
    logits = tf.maximum(logits, lowest)
    row_max = tf.reduce_max(logits, axis=axis, keepdims=True)
    return tf.where(row_max <= lowest, tf.zeros([], x.dtype), tf.nn.softmax(logits, axis=axis))


def _softmax_rows_from_mask(x, keep, axis, out_dtype):
    """The fused softmax for logits that hold no `-inf`; rows the mask empties are zeroed in `out_dtype`."""
    if keep is None:
        return tf.cast(tf.nn.softmax(x, axis=axis), out_dtype)
    probs = tf.nn.softmax(tf.where(keep, x, tf.constant(x.dtype.min, x.dtype)), axis=axis)
    for _ in range(x.shape.rank - keep.shape.rank):  # a broadcast mask: `axis` counts in `x`'s rank
        keep = keep[None]
    row_kept = tf.reduce_any(keep, axis=axis, keepdims=True)
    return tf.where(row_kept, tf.cast(probs, out_dtype), tf.zeros([], out_dtype))
