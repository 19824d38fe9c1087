"""The half weights `kmix.export` serves (`HalfWeights`) and stores (`store_in_half`): which variables go half."""

import keras
import numpy as np
import tensorflow as tf

from kmix import _compat
from kmix._tree import own_weights, walk
from kmix.diagnose.probe import HALF_RANGES
from kmix.placing import twin, write
from kmix.serving import artifact


@keras.saving.register_keras_serializable(package="kmix")
class HalfStoragePolicy(keras.DTypePolicy):
    """A dtype policy that stores variables in a half dtype and computes in float32 (`mixed_bfloat16` reversed).

    A layer carries it in a `keras.dtype_policies.DTypePolicyMap`, which `load_model` restores with `kmix` imported.

    Args:
        name: `"stored_bfloat16"` or `"stored_float16"`, or the half dtype itself (`"bfloat16"`, `"float16"`).

    Example:

    >>> policy = HalfStoragePolicy("bfloat16")
    >>> policy.name, policy.variable_dtype, policy.compute_dtype
    ('stored_bfloat16', 'bfloat16', 'float32')
    """

    def __init__(self, name="stored_bfloat16"):
        half = name.removeprefix("stored_") if isinstance(name, str) else None
        if half not in HALF_RANGES:
            raise ValueError("`name` must be 'stored_bfloat16' or 'stored_float16' (or 'bfloat16' / 'float16'). "
                             f"Received: name={name!r}")
        super().__init__("float32")
        self._name, self._half = f"stored_{half}", half

    @property
    def variable_dtype(self):
        """The half dtype the variables are stored in."""
        return self._half


def _chosen(model, half, float32_compute_only=False):
    """`(rows, kept)`: `(path, layer, float32 variables, in_float32)` of each layer whose variables go half, and
    `{path: why}` for the float32 layers holding a matrix that keep float32 (a value beyond the half range)."""
    rows, kept = [], {}
    for path, layer, _ in walk(model):
        weights = [v for v in own_weights(layer) if keras.backend.standardize_dtype(v.dtype) == "float32"]
        in_float32, has_matrix = layer.compute_dtype == "float32", any(len(v.shape) >= 2 for v in weights)
        if not weights or (in_float32 and not has_matrix) or (float32_compute_only and not in_float32):
            continue
        largest = max(float(tf.reduce_max(tf.abs(v.value))) if int(np.prod(v.shape)) else 0.0 for v in weights)
        if largest <= HALF_RANGES[half].max:
            rows.append((path, layer, weights, in_float32))
        elif in_float32:
            kept[path] = f"a value of {largest:.4g} is beyond {half}'s range"
    return rows, kept


class HalfWeights:
    """Half copies of `model`'s weights, as `kmix.export` serves a SavedModel.

    Attributes:
        pairs: `(model variable, half tf.Variable)` for every weight served half.
        stored_in_half: the paths of the float32-computing layers whose matrices are served half.
        kept_float32: `{path: why}` for the float32 layers holding a matrix served in float32.
    """

    def __init__(self, model, half):
        self.model, self.half = model, half
        rows, self.kept_float32 = _chosen(model, half)
        self.stored_in_half = [path for path, _, _, in_float32 in rows if in_float32]
        self.pairs, self._swapped, self._mapped = [], [], []  # all pairs; those of half layers / of float32 layers
        for _, _, weights, in_float32 in rows:
            for variable in weights:
                pair = (variable, tf.Variable(tf.cast(variable.value, half), trainable=False,
                                              name=variable.path.replace("/", "_")))
                self.pairs.append(pair)
                (self._mapped if in_float32 else self._swapped).append(pair)

    def serving(self):
        """A context in which the half layers' variables read their half copies (their storage swapped)."""
        return _compat.storage_swapped(self._swapped)

    def call(self, x):
        """The model on `x` with the half weights in, outputs float32; inside `serving()`."""
        mapping = [(variable, tf.cast(copy, "float32")) for variable, copy in self._mapped]
        with keras.StatelessScope(state_mapping=mapping):
            return artifact.as_float32(self.model(x, training=False))

    def variables(self):
        """The half variables (the artifact stores them)."""
        return [copy for _, copy in self.pairs]

    def bytes(self):
        """`(bytes served, the same weights in float32)` over every variable of the model."""
        return weight_bytes(self.model, {id(v) for v, _ in self.pairs})


def store_in_half(model, half):
    """Gives the float32 layers of `model` (placed as O2) that hold a matrix `half` variables; their compute stays.

    Returns `(stored, kept)`: the paths of the layers now storing half variables, and `{path: reason}` for the
    float32 layers with a matrix that keep float32 variables (a value beyond the half range).
    """
    rows, kept = _chosen(model, half, float32_compute_only=True)
    stored = [path for path, _, _, _ in rows]
    for _, layer, weights, _ in rows:
        for variable in weights:
            _compat.recast_variable(variable, half)
        policy, current = HalfStoragePolicy(half), layer.dtype_policy
        if isinstance(current, keras.dtype_policies.DTypePolicyMap):
            layer.dtype_policy = policy  # written into the map under the layer's path
        else:  # a map is the one form a saved config keeps the policy in
            layer.dtype_policy = keras.dtype_policies.DTypePolicyMap(default_policy=current,
                                                                     policy_map={layer.path: policy})
    if stored:
        # A block re-creating a stored layer with its own dtype (keras-hub's token embedding) records it in its map.
        rebuilt = twin.build(model)
        found = twin.differences(model, rebuilt.model) if rebuilt.error is None else None
        if found:
            write.record_maps(model, found, rebuilt.model)
    return stored, kept


def weight_bytes(model, served_half=()):
    """`(bytes as stored, bytes in float32)` of `model`'s variables; `served_half`: ids of those served in 2 bytes."""
    stored = as_float32 = 0
    for variable in model.weights:
        size, dtype = int(np.prod(variable.shape)), keras.backend.standardize_dtype(variable.dtype)
        itemsize = 2 if id(variable) in served_half or dtype in ("bfloat16", "float16") else np.dtype(dtype).itemsize
        stored += size * itemsize
        as_float32 += size * (4 if keras.backend.is_float_dtype(dtype) else itemsize)
    return stored, as_float32
