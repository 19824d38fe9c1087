"""The user's model served with half weights: no copy of the model, a half copy of the weights it serves.

`kmix.export` places the model itself (`kmix.autocast` under O1 with the
export's half dtype: compute dtypes only, the float32 variables stay) and
serves it through `HalfWeights`: each float32 variable a half layer reads,
and the weights of a float32 layer holding a matrix (the output layer), get
a half `tf.Variable` holding its value rounded. While `serving()` lasts, the
half layers' variables read their half copies (the same Keras variables,
their storage swapped: a half layer computes on half weights as under O2,
with no float32 copy in between), and `call` maps the float32 layers'
copies in (`keras.StatelessScope(state_mapping=...)`), read as float32
(`HalfStoragePolicy`'s arithmetic). Normalization vectors, values beyond
the half dtype's range and non-float variables are served from the model's
own variables. The half variables are the artifact's weights: 0.5x the
float32 bytes they replace, and all the memory serving adds.

    >>> weights = HalfWeights(model, "bfloat16")      # model placed in place first
    >>> with weights.serving():
    ...     out = weights.call(x)                      # float32 in, float32 out
"""

import keras
import numpy as np
import tensorflow as tf

from kmix import _compat
from kmix._tree import own_weights, walk

_HALF_MAX = {"float16": 65504.0, "bfloat16": float(np.finfo(np.float32).max)}


class HalfWeights:
    """Half copies of `model`'s weights, as `kmix.export` serves them (see the module).

    Attributes:
        pairs: `(model variable, half tf.Variable)` for every weight served half.
        stored_in_half: the paths of the float32-computing layers whose matrices are served half.
        kept_float32: `{path: why}` for the float32 layers holding a matrix served in float32.
    """

    def __init__(self, model, half):
        self.model, self.half = model, half
        self.pairs, self.stored_in_half, self.kept_float32 = [], [], {}
        self._swapped, self._mapped = [], []  # pairs of half layers / of float32 layers
        for path, layer, _ in walk(model):
            weights = [v for v in own_weights(layer) if keras.backend.standardize_dtype(v.dtype) == "float32"]
            in_float32 = layer.compute_dtype == "float32"
            has_matrix = any(len(v.shape) >= 2 for v in weights)
            chosen = weights if has_matrix or not in_float32 else []  # a float32 layer's vectors alone stay
            if not chosen:
                continue
            largest = max(_largest(v) for v in chosen)
            if largest > _HALF_MAX[half]:
                if in_float32:
                    self.kept_float32[path] = f"a value of {largest:.4g} is beyond {half}'s range"
                continue
            for variable in chosen:
                pair = (variable, tf.Variable(tf.cast(variable.value, half), trainable=False,
                                              name=variable.path.replace("/", "_")))
                self.pairs.append(pair)
                (self._mapped if in_float32 else self._swapped).append(pair)
            if in_float32:
                self.stored_in_half.append(path)

    def serving(self):
        """A context in which the half layers' variables read their half copies (see the module)."""
        return _compat.storage_swapped(self._swapped)

    def call(self, x):
        """The model on `x` (tensors) with the half weights in, outputs cast to float32; inside `serving()`."""
        mapping = [(variable, tf.cast(copy, "float32")) for variable, copy in self._mapped]
        with keras.StatelessScope(state_mapping=mapping):
            out = self.model(x, training=False)
        return keras.tree.map_structure(lambda t: tf.cast(t, tf.float32) if t.dtype.is_floating else t, out)

    def variables(self):
        """The half variables (the artifact stores them)."""
        return [copy for _, copy in self.pairs]

    def bytes(self):
        """`(bytes served, the same weights in float32)` over every float variable of the model."""
        half = {id(v) for v, _ in self.pairs}
        served = as_float32 = 0
        for variable in self.model.weights:
            size = int(np.prod(variable.shape))
            dtype = keras.backend.standardize_dtype(variable.dtype)
            itemsize = 2 if id(variable) in half or dtype in ("bfloat16", "float16") else np.dtype(dtype).itemsize
            served += size * itemsize
            as_float32 += size * (4 if keras.backend.is_float_dtype(dtype) else itemsize)
        return served, as_float32


def _largest(variable):
    value = variable.value
    return float(tf.reduce_max(tf.abs(value))) if int(np.prod(value.shape)) else 0.0
