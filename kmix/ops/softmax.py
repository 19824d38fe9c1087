"""Softmax and log-softmax that compute in float32 and select masked positions out.

A softmax in float16 fails two ways. A hand-made additive mask such as
`(1 - mask) * -1e9` is `-inf` in float16, and `0 * -inf` is NaN. And a float16
softmax over a long axis sums thousands of float16 values, an error of about
5e-4 against float64 where float32 gives about 2e-7.

The functions here cast the logits to float32 (float64 stays float64), never
add or multiply an infinity: a masked position is replaced with `where`, both
before the `exp` and after it (the "double where"), so its value and its
gradient are exactly zero, and a row with no position left gives zeros and zero
gradients rather than NaN or a uniform spread over padding. The arguments
(mask, bias, axis, dtype) are checked in `kmix.ops.arguments`.
"""

import keras
import numpy as np
import tensorflow as tf

from kmix.ops.arguments import align_to_logits, keep_from_mask, normalize_axis, output_dtype, warn_if_keep_mask

# An additive bias at or below this value masks its position, as `-inf` does.
# exp(-1e3) is 0 even in float64, so on a row that keeps a position with a
# bias near 0 masking such an entry changes nothing; it decides what a row
# whose every entry is this negative gives: zeros, not a uniform spread. It is
# -1e3 rather than -1e4 because BERT's -1e4 rounds to -9984 in bfloat16.
BIAS_MASK_THRESHOLD = -1e3


def masked_softmax(logits, mask=None, bias=None, axis=-1, dtype=None):
    """Softmax in float32 that zeroes masked positions and never gives NaN.

    A position is masked when `mask` is False (or <= 0.5), when `bias` is at or
    below -1e3 (`-1e4`, `-1e9`, `finfo.min` and `-inf` included, whatever the
    bias's dtype), or when its logit is `-inf`. Masked positions give exactly 0 and a
    zero gradient; a row with every position masked gives zeros.

    `mask` follows Keras: True (or 1) *keeps* a position. torch's
    `key_padding_mask` and boolean `attn_mask` are the opposite (True marks
    padding): pass `~mask` (`keras.ops.logical_not`). An additive bias
    (0 / -1e9, 0 / -inf) passed as `mask` is an error: a numeric mask must
    hold values in [0, 1]. Eagerly, or for a constant mask, this raises a
    `ValueError`; inside a `tf.function` an in-graph assertion raises
    `InvalidArgumentError`; under XLA, which drops assertions, the output
    is NaN instead, so the loss shows it. A `bias` holding only 0 and 1
    (a keep-mask passed as `bias`, which masks nothing) gives a warning when
    its values are known (eagerly or a constant).

    A mask or bias of lower rank than `logits` is read batch-first or
    aligned to the last axes, whichever its shape fits
    (`kmix.ops.arguments.align_to_logits`): on `(B, H, T, S)` scores a
    `(B, S)` mask is a key mask `(B, 1, 1, S)` and a `(T, S)` one is shared
    over the batch `(1, 1, T, S)`; one that fits both (`B == T`) raises a
    `ValueError` naming the shape to pass. With the batch unknown when
    traced, a mask whose first dimension is unknown too is a key mask.

    Args:
        logits: a float tensor (float16, bfloat16, float32 or float64).
        mask: optional; bool, or numeric with values in [0, 1] where a value
            > 0.5 keeps the position (True / 1 keeps, as in Keras).
            Broadcastable to `logits`; of lower rank, see below.
        bias: optional additive bias of any float dtype, broadcastable to
            `logits`: 0 keeps, values <= -1e3 (-1e4, -1e9, `finfo.min`,
            `-inf`) mask.
        axis: an int or a tuple of ints: the axes normalised over.
        dtype: the output dtype; `logits.dtype` by default.

    Returns:
        A tensor of `logits`'s shape and `dtype` (or `logits.dtype`), summing
        to 1 over `axis` on every row that keeps a position, 0 elsewhere.

    Example:
        >>> x = np.array([[1.0, 2.0, 3.0]], "float16")
        >>> kmix.ops.masked_softmax(x, mask=[[True, True, False]], dtype="float32")
        <tf.Tensor: shape=(1, 3), dtype=float32,
                    numpy=array([[0.26894143, 0.7310586 , 0.        ]], dtype=float32)>
    """
    return _masked_softmax(logits, mask, bias, axis, dtype, log=False)


def masked_log_softmax(logits, mask=None, bias=None, axis=-1, dtype=None):
    """Log-softmax in float32 for losses over masked positions; never NaN.

    Same arguments, masking rule and mask checks as `masked_softmax`
    (True / 1 in `mask` keeps a position). A masked position
    holds 0, not `-inf`, so `labels * log_probs` stays finite there (use the
    mask, not the value, to tell masked positions apart). Its gradient is 0.

    Args:
        logits: a float tensor (float16, bfloat16, float32 or float64).
        mask: optional; bool, or numeric with values in [0, 1] where a value
            > 0.5 keeps the position. Broadcastable to `logits`, as in
            `masked_softmax`.
        bias: optional additive bias of any float dtype, broadcastable to
            `logits`: 0 keeps, values <= -1e3 (-1e4, -1e9, `finfo.min`,
            `-inf`) mask.
        axis: an int or a tuple of ints: the axes normalised over.
        dtype: the output dtype; `logits.dtype` by default.

    Returns:
        A tensor of `logits`'s shape and dtype: `log(softmax)` at kept
        positions, 0 at masked ones.

    Example:
        >>> x = np.array([[0.0, 0.0, 5.0]], "float16")
        >>> kmix.ops.masked_log_softmax(x, bias=[[0.0, 0.0, -1e9]], dtype="float32")
        <tf.Tensor: shape=(1, 3), dtype=float32,
                    numpy=array([[-0.6931472, -0.6931472,  0.       ]], dtype=float32)>
    """
    return _masked_softmax(logits, mask, bias, axis, dtype, log=True)


def _masked_softmax(logits, mask, bias, axis, dtype, log, names=None, infinite_logits=True):
    """The shared body; `names` renames the arguments in error messages.

    `infinite_logits=False` is the caller's word that no logit is `-inf`
    (attention scores computed in bfloat16 or float32 from finite inputs:
    they cannot overflow): rows with nothing kept are then found from the
    mask alone and zeroed after the cast to the output dtype, two passes
    fewer over the largest tensor of a transformer's forward pass.
    """
    names = {"logits": "logits", "mask": "mask", "bias": "bias", **(names or {})}
    for name, value in (("logits", logits), ("mask", mask), ("bias", bias)):
        if keras.backend.is_keras_tensor(value):
            raise TypeError(
                f"`kmix.ops.masked_softmax` takes concrete tensors; "
                f"`{names[name]}` is a symbolic KerasTensor. In a functional "
                "model use the layer `kmix.layers.MaskedSoftmax` instead."
            )
    logits = tf.convert_to_tensor(logits)
    if not (logits.dtype.is_floating or logits.dtype.is_integer):
        raise TypeError(
            f"Received: {names['logits']}.dtype={logits.dtype.name}; expected a float tensor "
            "(float16, bfloat16, float32 or float64)."
        )
    out_dtype = output_dtype(logits.dtype, dtype)
    compute_dtype = tf.float64 if tf.float64 in (logits.dtype, out_dtype) else tf.float32
    rank = logits.shape.rank
    if rank is None or rank == 0:
        raise ValueError(
            f"`{names['logits']}` must have a known rank of at least 1 (a softmax normalises over an "
            f"axis). Received: {names['logits']}.shape={logits.shape}."
        )
    axes = normalize_axis(axis, rank, names["logits"])
    x = tf.cast(logits, compute_dtype)

    keep = None
    mask_ok = None
    if mask is not None:
        mask = tf.convert_to_tensor(mask)
        mask = align_to_logits(mask, logits.shape, names["mask"], names["logits"])
        keep, mask_ok = keep_from_mask(mask, names)
    if bias is not None:
        bias = tf.convert_to_tensor(bias)
        if not (bias.dtype.is_floating or bias.dtype.is_integer):
            hint = f" Pass a boolean mask as `{names['mask']}`." if bias.dtype == tf.bool else ""
            raise TypeError(
                f"Received: {names['bias']}.dtype={bias.dtype.name}; "
                f"expected a float dtype (0 keeps, large negatives mask).{hint}"
            )
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

    A masked position, and a `-inf` logit, become the dtype's lowest finite
    value rather than `-inf`, so that a row with nothing kept stays finite
    (`tf.nn.softmax` of a row of `-inf` is NaN); such a row, whose max is
    that lowest value, is then replaced with zeros. Elsewhere
    `exp(lowest - max)` is exactly 0. NaN stays NaN: `maximum` and
    `reduce_max` propagate it, and `row_max <= lowest` is False for it.

    The gradient is TensorFlow's own, through the selects: 0 at masked
    positions (their probability is exactly 0) and on rows with nothing kept
    (the last select). No `tf.custom_gradient`: in a traced function it
    registers a gradient in TensorFlow's global registry on every trace,
    which keeps the traced graph alive for the life of the process (every
    `predict`, `fit` and export trace of an attention model held its graph).
    """
    lowest = tf.constant(x.dtype.min, x.dtype)
    logits = x if keep is None else tf.where(keep, x, lowest)
    logits = tf.maximum(logits, lowest)
    row_max = tf.reduce_max(logits, axis=axis, keepdims=True)
    return tf.where(row_max <= lowest, tf.zeros([], x.dtype), tf.nn.softmax(logits, axis=axis))


def _softmax_rows_from_mask(x, keep, axis, out_dtype):
    """The fused softmax for logits that hold no `-inf`; rows with nothing kept zeroed by the mask.

    Masked positions take the lowest finite value, so every row stays finite
    and `tf.nn.softmax`'s own gradient applies; a row the mask empties comes
    out uniform and is replaced with zeros, in `out_dtype` (half the bytes
    of float32 for a half output), which also zeroes its gradient.
    """
    if keep is None:
        return tf.cast(tf.nn.softmax(x, axis=axis), out_dtype)
    probs = tf.nn.softmax(tf.where(keep, x, tf.constant(x.dtype.min, x.dtype)), axis=axis)
    for _ in range(x.shape.rank - keep.shape.rank):  # a broadcast mask: `axis` counts in `x`'s rank
        keep = keep[None]
    row_kept = tf.reduce_any(keep, axis=axis, keepdims=True)
    return tf.where(row_kept, tf.cast(probs, out_dtype), tf.zeros([], out_dtype))
