"""The checks on `diagnose`'s arguments, its batches, and made-up inputs for a model's input specs."""

import re

import keras
import numpy as np
import tensorflow as tf

from kmix import _checks as checks
from kmix.policy.policy import parse

_ARRAYS = "NumPy arrays or tensors (or a list, tuple or dict of them), or a tf.data.Dataset"


def check_model(model):
    """`model` if it is a compiled `keras.Model`; a clear error otherwise."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a compiled keras.Model. Received: model={model!r} "
                        f"(of type {type(model).__name__}).")
    if not getattr(model, "compiled", False):
        raise ValueError("`model` must be compiled: diagnose differentiates the loss given to `compile`. Received: "
                         f"model={model.name!r}, which is not compiled. Call `model.compile(optimizer=..., loss=...)`.")
    return model


def check_policy(policy):
    """`policy` as a `kmix.Policy` with half-precision compute; a clear error otherwise."""
    parsed = parse(policy, "policy")
    if parsed.compute_dtype == "float32":
        raise ValueError("`policy` must compute in float16 or bfloat16: diagnose compares the model in float32 with "
                         f"it. Received: policy={policy!r} (compute dtype float32). Accepted: 'mixed_float16', "
                         "'mixed_bfloat16', 'float16', 'bfloat16', 'O1'-'O3', or a jmp-style string with "
                         "compute=float16 or bfloat16.")
    return parsed


def check_float32_layers(float32_layers, nodes):
    """`float32_layers` as a set of names or paths of `nodes`' layers; a clear error otherwise."""
    if float32_layers is None:
        return set()
    try:
        names = set([float32_layers] if isinstance(float32_layers, str) else float32_layers)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(f"`float32_layers` must be a list of layer names or paths. Received: "
                        f"float32_layers={float32_layers!r}.")
    unknown = sorted(names - {n.path for n in nodes} - {n.layer.name for n in nodes})
    if unknown:
        raise ValueError(f"`float32_layers` names {unknown}, which are no layers of the model. Accepted: the "
                         "layer names and paths of the diagnosis table (its `layer` column).")
    return names


def check_float32(nodes):
    """Raises when a layer of the model already computes in a half dtype."""
    half = [n.path for n in nodes if n.layer.compute_dtype in ("float16", "bfloat16")]
    if half:
        dtype = nodes[0].layer.compute_dtype if len(nodes) == 1 else "a half dtype"
        raise ValueError("`model` must compute in float32: diagnose compares it with its half-precision run. Received "
                         f"a model whose layers {half[:5]} compute in {dtype}. Build it under float32 (inside "
                         "`kmix.policy_scope('float32')`).")


def batches(x, y, count, batch_size):
    """Up to `count` batches `(x, y, sample_weight)` from arrays or a `tf.data.Dataset`."""
    count = checks.integer("batches", count)
    dataset = isinstance(x, tf.data.Dataset)
    if dataset:
        if y is not None:
            raise ValueError("`y` must be None when `x` is a tf.data.Dataset: the dataset yields the targets. "
                             f"Received: y of type {type(y).__name__}.")
        found = [keras.utils.unpack_x_y_sample_weight(element) for element in x.take(count)]
        if not found:
            raise ValueError("`x` is an empty tf.data.Dataset; diagnose needs at least one batch.")
    else:
        batch_size = checks.integer("batch_size", batch_size)
        n = _length("x", x)
        if y is not None and _length("y", y) != n:
            raise ValueError(f"`x` and `y` must hold the same number of samples. Received: x with {n} and y "
                             f"with {_length('y', y)}.")
        cut = lambda data, start: keras.tree.map_structure(lambda a: a[start : start + batch_size], data)  # noqa: E731
        starts = range(0, n, batch_size)[:count]
        found = [(cut(x, start), None if y is None else cut(y, start), None) for start in starts]
    for position, name in ((0, "x"), (1, "y")):  # NaN raises; inf passes (an additive mask may hold -inf)
        parts = [batch[position] for batch in found if batch[position] is not None]
        leaves = [leaf for part in parts for leaf in keras.tree.flatten(part)]
        values = [v for v in map(float_values, leaves) if v is not None]
        nan = sum(int(np.isnan(v).sum()) for v in values)
        if nan:
            where = f"the dataset's {'inputs' if name == 'x' else 'targets'}" if dataset else f"`{name}`"
            raise ValueError(f"`{name}` holds NaN: {nan} of the {sum(v.size for v in values)} values diagnose would "
                             f"run ({where}, the first batches). The float32 loss would be NaN already, which no "
                             f"policy explains. Accepted: finite {name} (clean or drop those samples, e.g. "
                             "np.nan_to_num or a filter), then diagnose.")
    return found


def float_values(leaf):
    """`leaf` as a NumPy array where it holds floats (bfloat16 as float32), else None (ragged and sparse too)."""
    try:
        value = np.asarray(leaf)
    except (TypeError, ValueError):
        return None
    if value.dtype.name == "bfloat16":
        return value.astype(np.float32)
    return value if np.issubdtype(value.dtype, np.floating) else None


def _length(name, data):
    if data is None:
        raise TypeError(f"`{name}` must be {_ARRAYS}. Received: {name}=None.")
    try:
        leaves = keras.tree.flatten(data)
    except TypeError:
        leaves = [data]
    for leaf in leaves:
        if not isinstance(leaf, (np.ndarray, tf.Tensor)) and not hasattr(leaf, "__array__"):
            raise TypeError(f"`{name}` must be {_ARRAYS}. Received: {name} holding a {type(leaf).__name__}.")
        if not getattr(leaf, "shape", ()):
            raise ValueError(f"`{name}` must have a batch dimension. Received: a scalar in {name}.")
    lengths = {int(leaf.shape[0]) for leaf in leaves}
    if len(lengths) != 1:
        raise ValueError(f"Every array in `{name}` must hold the same number of samples. Received lengths "
                         f"{sorted(lengths)}." if lengths else f"`{name}` holds no arrays.")
    if lengths == {0}:
        raise ValueError(f"`{name}` holds no samples.")
    return lengths.pop()


def forward(model, x, argument="x", training=False):
    """`model(x, training=training)`; a `ValueError` naming `argument` where `x` does not fit the model."""
    try:
        return model(x, training=training)
    except (ValueError, TypeError, KeyError, tf.errors.InvalidArgumentError) as e:
        raise ValueError(f"`{argument}` does not fit model {model.name!r}'s inputs: calling the model on a batch of "
                         f"`{argument}` failed with {type(e).__name__}: {first_line(e, 300)}") from e


def first_line(error, width=200):
    """The informative line of an exception's message (Keras puts its own line and ANSI codes first), cut."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith("Exception encountered when calling")]
    return (useful or lines or [type(error).__name__])[0][:width]


def sample_inputs(specs, rows=2, length=8, seed=0, vocab=None):
    """Made-up NumPy inputs for `specs` (`tf.TensorSpec`s): `rows` rows, open axes `length` long.

    Floats standard normal in the spec's dtype; bools and inputs named like a mask ones; other integers (token
    ids) ones, or below `vocab`:

    >>> sample_inputs({"ids": tf.TensorSpec((None, None), "int32")}, vocab=100)["ids"].shape
    (2, 8)
    """
    rng = np.random.default_rng(seed)

    def make(path, spec):
        shape = [rows if i == 0 else (length if d is None else d) for i, d in enumerate(spec.shape)]
        dtype = keras.backend.standardize_dtype(spec.dtype)
        if keras.backend.is_float_dtype(dtype):
            return rng.standard_normal(shape).astype(dtype)
        if vocab is None or dtype == "bool" or "mask" in "/".join(str(p) for p in path).lower():
            return np.ones(shape, dtype)
        return rng.integers(0, vocab, size=shape).astype(dtype)

    flat = keras.tree.flatten_with_path(specs)
    return keras.tree.pack_sequence_as(specs, [make(path, spec) for path, spec in flat])
