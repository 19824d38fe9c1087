"""One symbolic call of a model, watching its layers: which layer raised, which produced the outputs.

Tracing `model(x)` in a `tf.function` on `tf.TensorSpec`s runs every layer's
`call` as a graph is built, with nothing computed: a dtype clash (a custom
layer adding its float32 noise to a half tensor with a raw TensorFlow op)
raises there, as it would in the first training step. Each layer's `call` is
wrapped for the trace only, so the innermost layer that raised is known, and
so is the layer that returned each of the model's outputs (a subclassed
model's graph is known no other way).
"""

import contextlib
import functools

import keras
import numpy as np
import tensorflow as tf

from kmix import _compat
from kmix._tree import is_graph_model, walk
from kmix.diagnose import probe


class Traced:
    """What one traced call found.

    Attributes:
        error: the exception the call raised, or None.
        culprit: the innermost layer whose `call` raised it, or None.
        outputs: the ids of the layers that returned the model's outputs
            (the outermost layer returning each output tensor).
        values: what an eager call returned (None for a traced graph, or an error).
    """

    def __init__(self, error, culprit, outputs, values=None):
        self.error, self.culprit, self.outputs, self.values = error, culprit, outputs, values


def input_specs(model, x=None):
    """The `tf.TensorSpec` structure to call `model` on, or None where nothing tells it.

    From `x` (arrays or tensors, or lists / dicts of them) when given, else
    from a graph model's inputs, else from the shape a subclassed model was
    built with (one input).
    """
    if x is not None:
        return keras.tree.map_structure(lambda t: _spec(t.shape, _dtype(t), batch=True), x)
    if is_graph_model(model) and getattr(model, "inputs", None):
        try:
            inputs = model.input  # the structure the model takes (a dict for keras-hub backbones)
        except AttributeError:  # a Sequential never called on a symbolic input
            inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
        return keras.tree.map_structure(lambda t: _spec(t.shape, t.dtype), inputs)
    shapes = _compat.built_input_shapes(model)
    if shapes and len(shapes) == 1:
        shape = next(iter(shapes.values()))
        if isinstance(shape, (tuple, list)) and all(d is None or isinstance(d, int) for d in shape):
            return _spec(shape, "float32", batch=True)
    return None


@contextlib.contextmanager
def untouched(model):
    """Puts back the tensors `model`'s layers hold as attributes, after a call on made-up inputs.

    A layer may cache what it computed from its inputs (keras-hub's
    `FlowMatchEulerDiscreteScheduler` keeps the sigmas of the number of
    steps it was last called with); a check's call must leave no such trace,
    symbolic or made up, in the user's model.
    """
    layers = [model] + [layer for _, layer, _ in walk(model)]
    saved = [(layer, dict(vars(layer))) for layer in layers]
    try:
        yield
    finally:
        for layer, before in saved:
            state = vars(layer)
            for name in list(state):
                old, new = before.get(name, _MISSING), state[name]
                if new is old or not (_is_cache(new) or _is_cache(old)):
                    continue
                if old is _MISSING:
                    del state[name]
                else:
                    state[name] = old


_MISSING = object()


def _is_cache(value):
    """A tensor a layer holds (not a variable), or the None it starts from."""
    if isinstance(value, keras.KerasTensor):
        return True
    return value is None or (keras.ops.is_tensor(value) and not isinstance(value, (keras.Variable, tf.Variable)))


def trace(model, specs, eager=False):
    """Builds the graph of `model(x, training=False)` for `specs`; returns a `Traced`.

    With `eager`, calls the model once instead, on `sample_inputs(specs)`: a
    model whose graph cannot be traced on open shapes (a Python branch on a
    tensor, a `range` over an unknown length) still shows where two dtypes
    meet.
    """
    layers = [layer for _, layer, _ in walk(model)]
    seen, producers, culprit = set(), {}, []
    with untouched(model), probe.wrapped_calls(
        layers, lambda layer, _: _watch(layer.call, layer, seen, producers, culprit)
    ):
        returned = []  # the tensors the model returns, inside the graph (tf.function adds identities after)
        try:
            if eager:
                returned.append(model(sample_inputs(specs), training=False))
            else:
                tf.function(lambda x: returned.append(model(x, training=False)), autograph=False).get_concrete_function(specs)
        except Exception as e:  # noqa: BLE001  reported to the caller with the layer that raised it
            return Traced(e, culprit[0] if culprit else None, set())
    found = set()
    for tensor in keras.tree.flatten(returned):
        layer = producers.get(id(tensor), (None, None))[1]
        if layer is not None:
            found.add(id(layer))
    return Traced(None, None, found, returned[0] if eager else None)


def _watch(original, layer, seen, producers, culprit):
    @functools.wraps(original)
    def call(*args, **kwargs):
        try:
            outputs = original(*args, **kwargs)
        except Exception as e:
            if id(e) not in seen:  # the innermost layer sees it first
                seen.add(id(e))
                culprit.append(layer)
            raise
        for tensor in keras.tree.flatten(outputs):
            producers[id(tensor)] = (tensor, layer)  # the tensor is kept, so its id is not reused
        return outputs

    return call


def _spec(shape, dtype, batch=False):
    shape = tuple(shape)
    if batch and shape:
        shape = (None,) + shape[1:]
    return tf.TensorSpec(shape, keras.backend.standardize_dtype(dtype))


def _dtype(value):
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return "float32"
    dtype = keras.backend.standardize_dtype(dtype)
    return "float32" if dtype == "float64" else dtype


def sample_inputs(specs, rows=2, length=8, seed=0):
    """Made-up inputs for `specs`: `rows` rows, unknown axes of `length`; ones for integers.

    Integer inputs (token ids, masks) are all ones, valid for any vocabulary
    and a mask that keeps every position; float inputs are normal values.
    """
    rng = np.random.default_rng(seed)

    def make(spec):
        shape = [rows if i == 0 else (length if d is None else d) for i, d in enumerate(spec.shape)]
        dtype = keras.backend.standardize_dtype(spec.dtype)
        if keras.backend.is_float_dtype(dtype):
            return rng.normal(size=shape).astype(dtype)
        if dtype == "bool":
            return np.ones(shape, bool)
        return np.ones(shape, dtype)

    return keras.tree.map_structure(make, specs)
