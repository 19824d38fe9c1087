"""`kmix.export`'s artifacts written and read back: a SavedModel as `model.export` writes it, or a `.keras` file."""

import copy
import json
import os
import pathlib
import tempfile
import time
import warnings
import zipfile

import keras
import numpy as np
import tensorflow as tf

from kmix._tree import is_graph_model, walk
from kmix.ops import float32_out
from kmix.placing.twin import differences, user_classes
from kmix.placing.trace import input_specs


def kind(path):
    """`"keras"` for a path ending in `.keras`, else `"tf_saved_model"` (a directory)."""
    return "keras" if str(path).endswith(".keras") else "tf_saved_model"


def write(served, path, sample, model):
    """Writes `served` to `path` (see `kind`), its inputs named as Keras names `model`'s (else from `sample`)."""
    if kind(path) == "keras":
        _write_keras_file(served, path)
        return

    def serve(*args):
        return as_float32(served(*args, training=False))

    # No `variables`: the endpoint tracks what it reads; the model's as well would store each twice (keras#23553).
    write_function(serve, input_signature(model, served, sample), path)


def write_function(serve, signature, path, variables=None):
    """Writes `serve` (a function of `signature`) as a SavedModel's `serve` endpoint at `path`, tracking `variables`."""
    archive = keras.export.ExportArchive()
    if variables is not None:
        archive.add_variable_collection("weights", list(variables))
    archive.add_endpoint("serve", serve, input_signature=signature)
    archive.write_out(path, verbose=False)


def input_signature(model, served, sample):
    """The `serve` endpoint's specs as Keras's `model.export` gives them: named after the inputs, floats float32.

    One argument for a functional model, one per input for a Sequential one, `sample`'s structure otherwise.
    """
    named = lambda t: _serving_spec(t.shape, t.dtype, t.name)  # noqa: E731
    if isinstance(model, keras.Sequential):
        return [named(t) for t in model.inputs]
    if is_graph_model(model) and getattr(model, "inputs", None):
        return [keras.tree.map_structure(named, model.input)]
    specs = input_specs(served) or input_specs(served, sample)
    return [keras.tree.map_structure(lambda s: _serving_spec(s.shape, s.dtype, None), specs)]


def load(path, model):
    """`(predict, seconds)`: the artifact at `path` read back (`model`'s classes in scope), and the time it took."""
    start = time.perf_counter()
    if kind(path) == "keras":
        with keras.saving.custom_object_scope(user_classes(model)):
            loaded = keras.models.load_model(path, compile=False, safe_mode=False)
        predict, float32 = (lambda x: loaded(x, training=False)), _written_in_float32(model)
        moved = [f"{path} (compute {mine[1]}, variables {mine[2]} as written; {theirs[1]}, {theirs[2]} loaded)"
                 for layer, path, mine, theirs, _ in differences(model, loaded).values()
                 if not (id(layer) in float32 and tuple(theirs[1:3]) == ("float32", "float32"))]
        if moved:
            warnings.warn(f"kmix.export wrote {path}, but `keras.models.load_model` rebuilds {len(moved)} of its "
                          f"layers in other dtypes: {moved[:8]}. They compute there as Keras rebuilds them (their "
                          "blocks or the model re-create them with a dtype of their own); the SavedModel serves the "
                          "model as written.", stacklevel=3)
    else:
        predict, _ = read_saved_model(path)
    return predict, time.perf_counter() - start


def read_saved_model(path):
    """`(predict, weights)`: a SavedModel read back: its `serve` endpoint, and its variables (None from `write`)."""
    loaded = tf.saved_model.load(str(path))
    weights = list(loaded.weights) if hasattr(loaded, "weights") else None
    return (lambda x: loaded.serve(_as_float32_inputs(x))), weights


def disk_bytes(path):
    """The bytes `path` takes: a file's size, or the sum over a directory's files."""
    path = pathlib.Path(path)
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def variables_bytes(path):
    """The bytes of a SavedModel's `variables/` (its weights), or of a `.keras` file's weights entry."""
    path = pathlib.Path(path)
    if kind(path) == "keras":
        with zipfile.ZipFile(path) as z:
            return sum(i.file_size for i in z.infolist() if i.filename.endswith(".h5"))
    return disk_bytes(path / "variables")


def _serving_spec(shape, dtype, name):
    dtype = tf.as_dtype(keras.backend.standardize_dtype(dtype))
    return tf.TensorSpec((None,) + tuple(shape)[1:], tf.float32 if dtype.is_floating else dtype, name=name)


def as_float32(outputs):
    """`outputs` (a structure of tensors), its floating tensors cast to float32."""
    return keras.tree.map_structure(lambda t: tf.cast(t, tf.float32) if t.dtype.is_floating else t, outputs)


def _as_float32_inputs(x):
    floating = lambda t: np.issubdtype(np.asarray(t).dtype, np.floating)  # noqa: E731
    return keras.tree.map_structure(lambda t: tf.cast(t, tf.float32) if floating(t) else tf.convert_to_tensor(t), x)


def _keras_config(model, path):
    """The config `model.save` writes for `model`, kmix's objects written as Keras's; a ValueError naming the rest."""
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    refused = []
    rewritten = _visit(copy.deepcopy(config), None, refused)
    if refused:
        raise ValueError(f"kmix.export cannot write {path} as a file Keras alone loads: the model holds kmix objects "
                         f"Keras has no class for: {'; '.join(refused[:8])}. A process loading it would need kmix. "
                         "Nothing was written. Export to a SavedModel directory instead (a path not ending in "
                         ".keras): it serves without kmix.")
    return rewritten


def check_keras_file(model, path):
    """Raises before anything is written where the file cannot be made, or Keras could not rebuild its config."""
    config = _keras_config(model, path)
    try:
        with keras.saving.custom_object_scope(user_classes(model)):
            keras.saving.deserialize_keras_object(config, safe_mode=False)
    # As `load_model` would fail (a bfloat16 LSTM: its orthogonal initializer's QR has no bfloat16 kernel).
    except (TypeError, ValueError, KeyError, AttributeError, NotImplementedError, tf.errors.OpError) as error:
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise ValueError(f"kmix.export cannot write {path}: `keras.models.load_model` could not rebuild the "
                         f"half-precision model from its config ({type(error).__name__}: {first}). Nothing was "
                         "written. Export to a SavedModel directory instead (a path not ending in .keras), which "
                         "serves the model as it is.") from error


def _write_keras_file(model, path):
    """Writes `model` to the `.keras` file `path`: Keras's file, its config holding no kmix object."""
    config = _keras_config(model, path)
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "model.keras")
        model.save(saved)
        with zipfile.ZipFile(saved) as source, zipfile.ZipFile(path, "w") as target:
            for info in source.infolist():
                data = json.dumps(config).encode() if info.filename == "config.json" else source.read(info)
                target.writestr(info, data)


def _written_in_float32(model):
    """The ids of `model`'s layers (float32 ones, kmix's, and those inside) the file may write under `float32`."""
    found = set()
    for _, layer, _ in walk(model):
        if (layer.compute_dtype == "float32" or type(layer).__module__.split(".")[0] == "kmix"
                or float32_out.is_wrapped(getattr(layer, "activation", None))):
            found.update([id(layer)] + [id(inner) for _, inner, _ in walk(layer)])
    return found


def _visit(node, layer, refused):
    """`node` (a serialized config) with kmix's objects written as Keras's; a line in `refused` per one left."""
    if isinstance(node, list):
        return [_visit(item, layer, refused) for item in node]
    if not isinstance(node, dict):
        return node
    node = _as_keras(node, layer, refused) if _is_kmix(node) else node
    inner = node.get("config")
    if isinstance(inner, dict) and _plain_activation(inner.get("activation")):
        # An output layer's float32-out activation: the plain one, the layer computing in float32.
        node = {**node, "config": {**inner, "activation": _plain_activation(inner["activation"]), "dtype": _float32()}}
        inner = node["config"]
    if isinstance(inner, dict) and isinstance(inner.get("name"), str) and "trainable" in inner:
        layer = inner["name"]  # a layer's config: what a refusal names
    return {key: _visit(value, layer, refused) for key, value in node.items()}


def _plain_activation(activation):
    """Keras's name of a serialized `kmix.ops.float32_out` activation (`"softmax"`), or None for any other."""
    name = activation.get("config") if isinstance(activation, dict) else None
    return name.removeprefix("kmix>float32_") if isinstance(name, str) and name.startswith("kmix>float32_") else None


def _float32():
    """Keras's `float32` policy as a saved config holds it."""
    return keras.saving.serialize_keras_object(keras.DTypePolicy("float32"))


def _is_kmix(node):
    module, registered = node.get("module"), node.get("registered_name")
    return ((isinstance(module, str) and module.split(".")[0] == "kmix")
            or (isinstance(registered, str) and registered.startswith("kmix>")))


def _as_keras(node, layer, refused):
    """Keras's counterpart of one serialized kmix object, or the object itself, its refusal recorded.

    A `HalfStoragePolicy` becomes Keras's `float32` (the weights half in the file), `kmix.layers.Softmax` Keras's
    in float32, `kmix.layers.MultiHeadAttention` Keras's with dropout 0 (float32 where Keras would not fuse: the
    fused path computes the softmax in float32).
    """
    name, inner = node["class_name"], dict(node.get("config") or {})
    where = f"layer {inner.get('name', layer)!r}"
    if name == "HalfStoragePolicy":
        return _float32()
    if name == "Softmax":
        inner.pop("output_dtype", None)
        inner.pop("autocast", None)
        return {**node, "module": "keras.layers", "registered_name": None, "config": {**inner, "dtype": _float32()}}
    if name == "MultiHeadAttention":
        calls = [n.get("kwargs") or {} for n in node.get("inbound_nodes") or [] if isinstance(n, dict)]
        if any(kwargs.get("attention_bias") is not None for kwargs in calls):
            refused.append(f"MultiHeadAttention called with `attention_bias` ({where}), which Keras's does not take")
            return node
        query = ((node.get("build_config") or {}).get("shapes_dict") or {}).get("query_shape")
        fused = not any(kw.get("return_attention_scores") for kw in calls) and (query is None or len(query) == 3)
        inner["dropout"] = 0.0
        if not fused:
            inner["dtype"] = _float32()
        return {**node, "module": "keras.layers", "registered_name": None, "config": inner}
    refused.append(f"{name} ({where})")
    return node
