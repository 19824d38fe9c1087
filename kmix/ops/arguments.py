"""The arguments of the safe ops, checked: masks, biases, axes and output dtypes.

Each check says what was received and what is accepted; where the values are unknown until the graph runs,
it goes into the graph (under XLA, which drops assertions, the caller turns the output into NaN).
"""

import warnings

import keras
import numpy as np
import tensorflow as tf


def keep_from_mask(mask, names=None):
    """The boolean keep-mask of a `mask` argument, checked against additive biases given as masks.

    A numeric mask must hold values in [0, 1] (> 0.5 keeps): where its values are known this raises a
    `ValueError`, otherwise an in-graph assertion is added.

    Args:
        mask: a tensor of bool, integer or float dtype.
        names: the argument names for the messages, `{"mask": ..., "bias": ...}`.

    Returns:
        `(keep, in_range)`: a bool tensor of `mask`'s shape, and the in-graph in-range flag (a bool scalar
        tensor, for the caller to make the output NaN where XLA drops assertions) or None.
    """
    names = {"mask": "mask", "bias": "bias", **(names or {})}
    mask = tf.convert_to_tensor(mask)
    if mask.dtype == tf.bool:
        return mask, None
    if not (mask.dtype.is_floating or mask.dtype.is_integer):
        raise TypeError(f"Received: {names['mask']}.dtype={mask.dtype.name}; expected bool, or an integer or float "
                        "dtype with values in [0, 1] where values > 0.5 keep a position.")
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
            raise ValueError(f"Received: {names['mask']} with values outside [0, 1] (min={low:g}, max={high:g}{nan}). "
                             f"{message}")
        return keep, None
    in_range = in_range_of(mask)
    as_float = tf.cast(mask, tf.float32)
    tf.debugging.Assert(in_range, [f"{names['mask']} has values outside [0, 1]. {message} min:",
                                   tf.reduce_min(as_float), "max:", tf.reduce_max(as_float)], name="mask_values_in_0_1")
    return keep, in_range


def _bias_as_mask_message(names):
    return (f"A numeric `{names['mask']}` keeps the positions where it is > 0.5 (True / 1 keeps, as in Keras; torch's "
            "key_padding_mask is the opposite: True marks padding, pass its logical_not). Negative values or values "
            f"above 1 look like an additive bias (0 keeps, -1e9 or -inf masks): pass it as `{names['bias']}=`"
            f"{names.get('bias_where', '')} instead.")


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
        warnings.warn(f"Received: {names['bias']} holding only 0 and 1. An additive bias of 0 and 1 masks nothing "
                      "(only values <= -1e3, e.g. -1e9 or -inf, mask). If it is a keep-mask (1 keeps, 0 masks), pass "
                      f"it as `{names['mask']}=` instead.", UserWarning, stacklevel=4)


def _known_values(tensor):
    """None in a graph unless `tensor` is a constant; else `evaluate(fn)` -> `fn(tensor)`'s value, computed on
    the device (eagerly on the constant in a graph) with only the result copied to the host."""
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
        raise ValueError(f"Received: dtype={dtype!r}; expected None or a float dtype ('float16', 'bfloat16', "
                         "'float32' or 'float64').")
    return out


def normalize_axis(axis, rank, logits_name="logits"):
    """`axis` (an int, or a tuple or list of ints into a tensor of `rank`) as a sorted tuple in `[0, rank)`."""
    items = list(axis) if isinstance(axis, (tuple, list)) else [axis]
    if (not items or not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) and -rank <= a < rank
                             for a in items) or len({int(a) % rank for a in items}) != len(items)):
        raise ValueError(f"Received: axis={axis!r}; expected an int or a non-empty tuple of distinct ints in "
                         f"[{-rank}, {rank}) for {logits_name} of rank {rank}.")
    return tuple(sorted(int(a) % rank for a in items))


def check_broadcastable(shape, target_shape, name, target_name, shown_shape=None):
    """Raises a ValueError unless `shape` broadcasts to `target_shape` unchanged (unknown dimensions pass).

    `name` and `target_name` name the arguments in the message; `shown_shape` is printed for `shape`.
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
        raise ValueError(f"The `{name}` must be broadcastable to `{target_name}`: each of its dimensions 1 or equal "
                         f"to the matching one, and it must not have more dimensions. Received: {name}.shape={shown}; "
                         f"expected a shape broadcastable to {tuple(target_dims)}.")


def align_to_logits(tensor, logits_shape, name, logits_name):
    """`tensor` (a mask or bias) with `logits`'s rank, by the rule for masks of lower rank; or raises.

    One of lower rank is read aligned to the last axes (a `(T, S)` causal mask -> `(1, 1, T, S)`) or
    batch-first (a `(B, S)` key mask on `(B, H, T, S)` scores -> `(B, 1, 1, S)`):

    ```
    d = tensor's first dimension; b = logits' first; a = the logits' axis R - r
    d == 1 or r <= 1           -> aligned to the last axes (both readings agree)
    d fits only one of b, a    -> that reading
    d == b == a, all known     -> ambiguous: ValueError naming the shapes to pass instead
    d known equal to one, the other unknown (None) -> the known one
    both unknown               -> batch-first (a dynamic batch-sized mask is a key mask)
    ```

    Args:
        tensor: the mask or the bias.
        logits_shape: the logits' shape.
        name, logits_name: the arguments' names, for the messages.

    Returns:
        `tensor`, with size-1 axes inserted up to the logits' rank.
    """
    shape, target = tf.TensorShape(tensor.shape), tf.TensorShape(logits_shape)
    if shape.rank is None or target.rank is None or shape.rank >= target.rank:
        check_broadcastable(shape, target, name, logits_name)
        return tensor
    dims, goal = shape.as_list(), target.as_list()
    r, rank = len(dims), len(goal)
    trailing = [1] * (rank - r) + dims
    batch_first = dims[:1] + [1] * (rank - r) + dims[1:]
    if r <= 1 or dims[0] == 1:  # one reading only
        check_broadcastable(trailing, target, name, logits_name, shown_shape=shape)
        return _expand(tensor, rank - r, 0)
    # The axes after the first align to the last ones in either reading.
    check_broadcastable([1] * (rank - r + 1) + dims[1:], target, name, logits_name, shown_shape=shape)
    fit_batch, fit_last = _fits(dims[0], goal[0]), _fits(dims[0], goal[rank - r])
    batch_index = "[:" + ", None" * (rank - r) + ", :" * (r - 1) + "]"
    last_index = "[" + ", ".join(["None"] * (rank - r)) + "]"
    readings = (f"batch-first, {tuple(batch_first)} (pass {name}{batch_index}: one row per example, e.g. a "
                f"key-padding mask), or aligned to the last axes, {tuple(trailing)} (pass {name}{last_index}: shared "
                "over the batch, e.g. a causal mask)")
    if fit_batch == fit_last == "no":
        raise ValueError(f"The `{name}` has fewer dimensions than `{logits_name}` and broadcasts to it neither "
                         f"batch-first nor aligned to the last axes. Received: {name}.shape={tuple(dims)}, "
                         f"{logits_name}.shape={tuple(goal)}; expected a shape broadcastable to {tuple(goal)}: "
                         f"with {rank} dimensions, or read {readings}.")
    if fit_batch == fit_last == "yes":
        raise ValueError(f"The `{name}` has fewer dimensions than `{logits_name}` and broadcasts two ways: its first "
                         f"axis ({dims[0]}) matches both the batch axis and axis {rank - r}. Received: "
                         f"{name}.shape={tuple(dims)}, {logits_name}.shape={tuple(goal)}. Pass it with {rank} "
                         f"dimensions: {readings}.")
    first = fit_batch != "no" and not (fit_last == "yes" and fit_batch == "maybe")
    return _expand(tensor, rank - r, 1 if first else 0)


def _fits(dim, target):
    """'yes', 'no' or 'maybe' (a dimension unknown until the graph runs)."""
    return "maybe" if dim is None or target is None else "yes" if dim == target else "no"


def _expand(tensor, count, axis):
    """`tensor` with `count` size-1 axes inserted at `axis` (0: in front; 1: after the batch axis)."""
    for _ in range(count):
        tensor = tf.expand_dims(tensor, axis)
    return tensor
