"""The checks' calls of a model: its input specs, and a call telling which layer raised and which made the outputs.

Each layer's `call` is watched for that call only; what the call leaves on the layers is put back (`Preserved`).
"""

import collections
import functools

import keras
import tensorflow as tf

from kmix import _compat, _preserved
from kmix._tree import is_graph_model
from kmix.diagnose.data import sample_inputs

Traced = collections.namedtuple("Traced", "error culprit outputs values")
Traced.__doc__ = """A call's error (or None), the innermost layer raising it, the output layers' ids, eager values."""


def attempt(function, *args, **kwargs):
    """`(function(*args, **kwargs), None)`, or `(None, the exception)`: user code run for a verdict."""
    try:
        return function(*args, **kwargs), None
    except Exception as e:  # noqa: BLE001  the user's model or layer failing on a check's made-up inputs or
        return None, e  # its config: the check's verdict ("fails in half", "cannot reload"), never autocast's crash


def input_specs(model, x=None):
    """The `tf.TensorSpec`s to call `model` on: from `x`, a graph model's inputs or a subclassed model's build shape."""
    if x is not None:
        return keras.tree.map_structure(lambda t: _spec(t.shape, getattr(t, "dtype", None), batch=True), x)
    if is_graph_model(model) and getattr(model, "inputs", None):
        try:
            inputs = model.input  # the structure the model takes (a dict for keras-hub backbones)
        except AttributeError:  # a Sequential never called on a symbolic input
            inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
        return keras.tree.map_structure(lambda t: _spec(t.shape, t.dtype), inputs)
    shapes = _compat.built_input_shapes(model)
    shape = next(iter(shapes.values())) if shapes and len(shapes) == 1 else None
    if isinstance(shape, (tuple, list)) and all(d is None or isinstance(d, int) for d in shape):
        return _spec(shape, "float32", batch=True)
    return None


def call(model, specs):
    """`(model(sample_inputs(specs), training=False), None)` or `(None, error)`; the model left as it was."""
    with _preserved.Preserved(model, saved="none"):  # a layer may cache what it computed (SD3's scheduler)
        return attempt(model, sample_inputs(specs), training=False)


def trace(model, layers, specs, eager=False):
    """A `Traced` of `model(x, training=False)` on `specs`, watching `layers` (`eager`: called on made-up inputs)."""
    producers, culprit, returned = {}, [], []

    def watched(layer, _):
        original = layer.call

        @functools.wraps(original)
        def watch(*args, **kwargs):
            done = False
            try:
                outputs = original(*args, **kwargs)
                done = True
            finally:
                if not done:
                    culprit.append(layer)  # the innermost layer's frame unwinds first
            for tensor in keras.tree.flatten(outputs):
                producers[id(tensor)] = (tensor, layer)  # the tensor is kept: its id is not reused
            return outputs

        return watch

    def run():
        if eager:
            returned.append(model(sample_inputs(specs), training=False))
        else:  # tf.function adds identities after the outputs: the tensors inside are recorded
            traced = tf.function(lambda x: returned.append(model(x, training=False)), autograph=False)
            traced.get_concrete_function(specs)

    with _preserved.Preserved(model, saved="none"), _compat.calls_replaced(layers, watched):
        _, error = attempt(run)
    if error is not None:
        return Traced(error, culprit[0] if culprit else None, set(), None)
    found = {id(producers[id(t)][1]) for t in keras.tree.flatten(returned) if id(t) in producers}
    return Traced(None, None, found, returned[0] if eager else None)


def is_dtype_error(error):
    """Whether `error` is two dtypes meeting (what half precision can cause), not a shape or trace error."""
    message = str(error).split("Arguments received by")[0]  # Keras lists the call's arguments, dtypes and all
    return any(word in message for word in ("float16", "bfloat16", "half", "float32", "float64", "dtype", "DT_"))


def first_words(error):
    """The error's class and first line that says something (Keras starts with "Exception encountered")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Exception encountered")] or lines or [""]
    return f"{type(error).__name__}: {lines[0].replace(chr(27) + '[1m', '').replace(chr(27) + '[0m', '')[:160]}"


def _spec(shape, dtype, batch=False):
    """A spec of `shape` (its batch axis open with `batch`, where float64 arrays give float32)."""
    dtype, shape = "float32" if dtype is None else keras.backend.standardize_dtype(dtype), tuple(shape)
    dtype = "float32" if batch and dtype == "float64" else dtype
    return tf.TensorSpec((None,) + shape[1:] if batch and shape else shape, dtype)
