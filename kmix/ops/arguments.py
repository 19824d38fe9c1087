"""The arguments of the safe ops, checked: masks, biases, axes and output dtypes.

`kmix.ops.masked_softmax` and `kmix.layers.MultiHeadAttention` take a
mask that keeps positions (True / 1 keeps, as in Keras), an additive bias
(0 keeps, -1e9 or -inf masks), an axis and an output dtype. Users mix the
first two up (torch's masks are the opposite of Keras's; an additive mask
passed as `mask`), so each check here says what was received and what is
accepted; where the values are unknown until the graph runs, the check
goes into the graph (and, under XLA, which drops assertions, the caller
turns the output into NaN so that the loss shows it).
"""

import warnings

import keras
import numpy as np
import tensorflow as tf


def keep_from_mask(mask, names=None):
    """The boolean keep-mask of a `mask` argument, checked against additive biases.

    A bool mask is returned as is. A numeric mask must hold values in
    [0, 1] (a value > 0.5 keeps); anything else, typically an additive bias
    such as 0 / -1e9 or 0 / -inf given as `mask`, raises a `ValueError` when
    the values are known (eager tensors, constants). Otherwise an in-graph
    assertion is added and the second return value is the in-range flag, for
    the caller to turn the output into NaN where assertions are dropped (XLA).

    Args:
        mask: a tensor of bool, integer or float dtype.
        names: the argument names for the messages, `{"mask": ..., "bias": ...}`.

    Returns:
        `(keep, in_range)`: a bool tensor of `mask`'s shape, and None or a bool
        scalar tensor (None when the check was done in Python or not needed).
    """
    names = {"mask": "mask", "bias": "bias", **(names or {})}
    mask = tf.convert_to_tensor(mask)
    if mask.dtype == tf.bool:
        return mask, None
    if not (mask.dtype.is_floating or mask.dtype.is_integer):
        raise TypeError(
            f"Received: {names['mask']}.dtype={mask.dtype.name}; "
            "expected bool, or an integer or float dtype with values in [0, 1] "
            "where values > 0.5 keep a position."
        )
    keep = tf.greater(mask, tf.cast(0.5, mask.dtype))
    message = _bias_as_mask_message(names)

    def in_range_of(m):
        return tf.reduce_all(tf.logical_and(m >= tf.zeros([], m.dtype), m <= tf.ones([], m.dtype)))

    values = _known_values(mask)
    if values is not None:
        if not bool(values(in_range_of)):  # one scalar to the host; the values only on error
            values = np.asarray(values(lambda m: m), np.float64)
            finite = values[~np.isnan(values)]
            low, high = (finite.min(), finite.max()) if finite.size else (np.nan, np.nan)
            nan = ", NaN" if np.isnan(values).any() else ""
            raise ValueError(
                f"Received: {names['mask']} with values outside [0, 1] "
                f"(min={low:g}, max={high:g}{nan}). {message}"
            )
        return keep, None
    in_range = in_range_of(mask)
    as_float = tf.cast(mask, tf.float32)
    tf.debugging.Assert(
        in_range,
        [f"{names['mask']} has values outside [0, 1]. {message} min:",
         tf.reduce_min(as_float), "max:", tf.reduce_max(as_float)],
        name="mask_values_in_0_1",
    )
    return keep, in_range


def _bias_as_mask_message(names):
    where = names.get("bias_where", "")
    return (
        f"A numeric `{names['mask']}` keeps the positions where it is > 0.5 (True / 1 keeps, "
        "as in Keras; torch's key_padding_mask is the opposite: True marks padding, pass "
        "its logical_not). Negative values or values above 1 look like an additive bias "
        f"(0 keeps, -1e9 or -inf masks): pass it as `{names['bias']}=`{where} instead."
    )


def warn_if_keep_mask(bias, names):
    """Warns when `bias` holds only 0 and 1: a keep-mask given as a bias masks nothing."""
    values = _known_values(bias)
    if values is None:
        return

    def keep_mask_like(b):
        zero, one = tf.zeros([], b.dtype), tf.ones([], b.dtype)
        only_0_1 = tf.reduce_all(tf.logical_or(tf.equal(b, zero), tf.equal(b, one)))
        return tf.logical_and(only_0_1, tf.reduce_any(tf.equal(b, one)))

    if bool(values(keep_mask_like)):
        warnings.warn(
            f"Received: {names['bias']} holding only 0 and 1. An additive bias of 0 and 1 "
            "masks nothing (only values <= -1e3, e.g. -1e9 or -inf, mask). If it is a "
            f"keep-mask (1 keeps, 0 masks), pass it as `{names['mask']}=` instead.",
            UserWarning,
            stacklevel=4,
        )


def _known_values(tensor):
    """None in a graph unless `tensor` is a constant; else `evaluate(fn)` -> `fn(tensor)`'s value.

    Eagerly `fn` runs on the device and only its (scalar) result is copied to
    the host; for a constant in a graph it runs eagerly on the constant.
    """
    if tf.executing_eagerly():
        return lambda fn: fn(tensor).numpy()
    static = tf.get_static_value(tensor)
    if static is None:
        return None
    with tf.init_scope():  # eager, outside the graph being traced
        constant = tf.constant(static)
    return lambda fn: _eager(fn, constant)


def _eager(fn, constant):
    with tf.init_scope():
        return fn(constant).numpy()


def output_dtype(logits_dtype, dtype):
    """The dtype of the op's output: `dtype`, else the logits' (floatx for non-float logits); raises on a non-float."""
    if dtype is None:
        return logits_dtype if logits_dtype.is_floating else tf.as_dtype(keras.config.floatx())
    try:
        out = tf.as_dtype(keras.backend.standardize_dtype(dtype))
    except (TypeError, ValueError):
        out = None
    if out is None or not out.is_floating:
        raise ValueError(
            f"Received: dtype={dtype!r}; expected None or a float dtype "
            "('float16', 'bfloat16', 'float32' or 'float64')."
        )
    return out


def normalize_axis(axis, rank, logits_name="logits"):
    """Returns `axis` as a sorted tuple of non-negative ints, or raises.

    Args:
        axis: an int, or a tuple or list of ints.
        rank: the rank of the tensor the axes index.
        logits_name: the argument's name, for the error message.

    Returns:
        A sorted tuple of distinct ints in `[0, rank)`.
    """
    items = list(axis) if isinstance(axis, (tuple, list)) else [axis]
    accepted = (
        f"expected an int or a non-empty tuple of distinct ints in "
        f"[{-rank}, {rank}) for {logits_name} of rank {rank}."
    )
    if not items or not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in items):
        raise ValueError(f"Received: axis={axis!r}; {accepted}")
    if not all(-rank <= a < rank for a in items):
        raise ValueError(f"Received: axis={axis!r}; {accepted}")
    axes = sorted(int(a) % rank for a in items)
    if len(set(axes)) != len(axes):
        raise ValueError(f"Received: axis={axis!r}; {accepted}")
    return tuple(axes)


def check_broadcastable(shape, target_shape, name, target_name, shown_shape=None):
    """Raises a ValueError unless `shape` broadcasts to `target_shape` unchanged.

    Each dimension, aligned from the right, must be 1 or equal to the target's,
    and `shape` must not have more dimensions (as `keras.layers.Softmax`).
    Unknown dimensions are not checked.

    Args:
        shape: the shape to check (a `tf.TensorShape` or tuple).
        target_shape: the shape it must broadcast to.
        name: the argument's name, for the message.
        target_name: the target argument's name, for the message.
        shown_shape: the shape to print, when `shape` was reshaped first.
    """
    shape = tf.TensorShape(shape)
    target_shape = tf.TensorShape(target_shape)
    if shape.rank is None or target_shape.rank is None:
        return
    dims, target_dims = shape.as_list(), target_shape.as_list()
    fits = len(dims) <= len(target_dims) and all(
        d is None or t is None or d in (1, t) for d, t in zip(dims[::-1], target_dims[::-1])
    )
    if not fits:
        shown = tuple(tf.TensorShape(shown_shape if shown_shape is not None else shape).as_list())
        raise ValueError(
            f"The `{name}` must be broadcastable to `{target_name}`: each of its "
            f"dimensions 1 or equal to the matching one, and it must not have "
            f"more dimensions. Received: {name}.shape={shown}; expected a shape "
            f"broadcastable to {tuple(target_dims)}."
        )
