"""Half-precision storage for the layers that compute in float32: `HalfStoragePolicy`.

A model placed under O2 stores the variables of its half layers in the half
dtype, and keeps float32 variables for its float32 islands: normalization
and the layers producing the outputs. Normalization holds vectors (scales,
statistics), a small share of the bytes; an output layer holds a matrix
(a classifier's head, a language model's vocabulary projection), which can
be a third of a small model. `store_in_half` gives such a layer half
variables while it still computes in float32: its policy's variable dtype
is half and its compute dtype float32, so Keras casts each variable to
float32 as the layer reads it (the cast Keras makes for `mixed_*` policies,
the other way round). Only the weights are rounded; the arithmetic stays
float32.
"""

import keras
import numpy as np

from kmix import _compat
from kmix.placing import reload
from kmix._tree import own_weights, walk

_HALF_MAX = {"float16": 65504.0, "bfloat16": float(np.finfo(np.float32).max)}


@keras.saving.register_keras_serializable(package="kmix")
class HalfStoragePolicy(keras.DTypePolicy):
    """A dtype policy that stores variables in a half dtype and computes in float32.

    The reverse of Keras's `mixed_bfloat16`: a layer under
    `HalfStoragePolicy("bfloat16")` creates its variables in bfloat16 (half
    the bytes of float32) and runs its `call` in float32, its variables cast
    to float32 as they are read. `kmix.export` gives it to the float32 layers
    of a served model that hold matrices (the output layer).

    Keras turns a plain policy in a layer's config back into its name, which
    this policy is not; a layer carries it inside a
    `keras.dtype_policies.DTypePolicyMap` (see `store_in_half`), which
    `keras.models.load_model` restores with `kmix` imported. The `.keras`
    file `kmix.export` writes holds Keras's `float32` policy in its place
    (`kmix.serving.keras_file`): Keras alone loads it, the weights still
    half in the file.

    Args:
        name: `"stored_bfloat16"` or `"stored_float16"`, or the half dtype
            itself (`"bfloat16"`, `"float16"`).

    Example:

    >>> policy = HalfStoragePolicy("bfloat16")
    >>> policy.name, policy.variable_dtype, policy.compute_dtype
    ('stored_bfloat16', 'bfloat16', 'float32')
    """

    def __init__(self, name="stored_bfloat16"):
        half = name.removeprefix("stored_") if isinstance(name, str) else None
        if half not in _HALF_MAX:
            raise ValueError(
                "`name` must be 'stored_bfloat16' or 'stored_float16' (or 'bfloat16' / 'float16'). "
                f"Received: name={name!r}"
            )
        super().__init__("float32")
        self._name = f"stored_{half}"
        self._half = half

    @property
    def variable_dtype(self):
        """The half dtype the variables are stored in."""
        return self._half


def store_in_half(model, half):
    """Gives the float32 layers of `model` that hold a matrix half variables; float32 compute stays.

    A float32 layer holding only vectors (a normalization's scale and
    statistics) keeps float32 variables, and so does one whose values do not
    fit the half dtype (beyond float16's 65504).

    Args:
        model: a model placed under a half-parameter policy (`kmix.autocast(..., "O2")`).
        half: `"bfloat16"` or `"float16"`.

    Returns:
        `(stored, kept)`: the paths of the layers now storing half variables,
        and `{path: reason}` for the float32 layers with a matrix that keep
        float32 variables.
    """
    stored, kept = [], {}
    for path, layer, _ in walk(model):
        weights = [v for v in own_weights(layer) if _is_float32(v)]
        if layer.compute_dtype != "float32" or not any(len(v.shape) >= 2 for v in weights):
            continue
        largest = max(float(np.max(np.abs(v.numpy()))) if np.size(v.numpy()) else 0.0 for v in weights)
        if largest > _HALF_MAX[half]:
            kept[path] = f"a value of {largest:.4g} is beyond {half}'s range"
            continue
        for variable in weights:
            _compat.recast_variable(variable, half)
        _set_policy(layer, HalfStoragePolicy(half))
        stored.append(path)
    if stored:
        _record_for_reload(model)
    return stored, kept


def weight_bytes(model):
    """`(bytes as stored, bytes in float32)` of `model`'s float variables; other variables count as they are."""
    stored = as_float32 = 0
    for variable in model.weights:
        size = int(np.prod(variable.shape))
        dtype = np.dtype(keras.backend.standardize_dtype(variable.dtype)) if not _is_bfloat16(variable) else None
        itemsize = 2 if dtype is None else dtype.itemsize
        stored += size * itemsize
        as_float32 += size * (4 if _is_floating(variable) else itemsize)
    return stored, as_float32


def _set_policy(layer, policy):
    """Sets `policy` on `layer` inside a policy map, the one form a saved config keeps it in."""
    current = layer.dtype_policy
    if isinstance(current, keras.dtype_policies.DTypePolicyMap):
        layer.dtype_policy = policy  # written into the map under the layer's path
    else:
        layer.dtype_policy = keras.dtype_policies.DTypePolicyMap(default_policy=current, policy_map={layer.path: policy})


def _record_for_reload(model):
    """Where a block re-creates a stored layer with its own dtype (a keras-hub backbone's token
    embedding), the block's policy map records the layer's, so that `load_model` restores it."""
    copy, error = reload.reloaded(model)
    if error is None:
        found = reload.differences(model, copy)
        if found:
            reload.record(model, found, copy)


def _is_float32(variable):
    return keras.backend.standardize_dtype(variable.dtype) == "float32"


def _is_bfloat16(variable):
    return keras.backend.standardize_dtype(variable.dtype) == "bfloat16"


def _is_floating(variable):
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(variable.dtype))
