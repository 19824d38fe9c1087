"""The `.keras` file `kmix.export` writes: one Keras alone loads, kmix's objects written as Keras's own.

Each counterpart computes as kmix's object does: a `HalfStoragePolicy` layer
and a `float32_out` output layer are written under Keras's `float32` (their
weights half in the file), `kmix.layers.Softmax` as Keras's in float32, and
`kmix.layers.MultiHeadAttention` as Keras's (its fused path computes the
softmax in float32; dropout written as 0, and in float32 where Keras would
not fuse). Any other kmix object refuses the file before anything is written.
"""

import copy
import json
import os
import tempfile
import zipfile

import keras
import tensorflow as tf

from kmix._tree import walk
from kmix.ops import float32_out
from kmix.placing.twin import user_classes

_CONFIG = "config.json"


def keras_config(model, path):
    """The config `model.save` writes for `model`, kmix's objects written as Keras's; a ValueError naming the rest."""
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    rewritten, refused = rewrite(config)
    if refused:
        raise ValueError(
            f"kmix.export cannot write {path} as a file Keras alone loads: the model holds kmix objects Keras has "
            f"no class for: {'; '.join(refused[:8])}. A process loading it would need kmix. Nothing was written. "
            "Export to a SavedModel directory instead (a path not ending in .keras): it serves without kmix."
        )
    return rewritten


def check(model, path):
    """Raises before anything is written where the file cannot be made, or Keras could not rebuild its config."""
    config = keras_config(model, path)
    try:
        with keras.saving.custom_object_scope(user_classes(model)):
            keras.saving.deserialize_keras_object(config, safe_mode=False)
    # As `load_model` would fail (a bfloat16 LSTM: its orthogonal initializer's QR has no bfloat16 kernel).
    except (TypeError, ValueError, KeyError, AttributeError, NotImplementedError, tf.errors.OpError) as error:
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise ValueError(
            f"kmix.export cannot write {path}: `keras.models.load_model` could not rebuild the half-precision "
            f"model from its config ({type(error).__name__}: {first}). Nothing was written. Export to a "
            "SavedModel directory instead (a path not ending in .keras), which serves the model as it is."
        ) from error


def write(model, path):
    """Writes `model` to the `.keras` file `path`: Keras's file, its config holding no kmix object."""
    config = keras_config(model, path)
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "model.keras")
        model.save(saved)
        with zipfile.ZipFile(saved) as source, zipfile.ZipFile(path, "w") as target:
            for info in source.infolist():
                data = json.dumps(config).encode() if info.filename == _CONFIG else source.read(info)
                target.writestr(info, data)


def written_in_float32(model):
    """The ids of `model`'s layers (float32 ones, kmix's, and those inside) the file may write under `float32`."""
    found = set()
    for _, layer, _ in walk(model):
        if (layer.compute_dtype == "float32" or type(layer).__module__.split(".")[0] == "kmix"
                or float32_out.is_wrapped(getattr(layer, "activation", None))):
            found.update([id(layer)] + [id(inner) for _, inner, _ in walk(layer)])
    return found


def rewrite(config):
    """`(config, refused)`: a serialized config with kmix's objects written as Keras's, and a line per one left."""
    refused = []
    return _visit(copy.deepcopy(config), None, refused), refused


def _visit(node, layer, refused):
    if isinstance(node, list):
        return [_visit(item, layer, refused) for item in node]
    if not isinstance(node, dict):
        return node
    if _is_kmix(node):
        node = _as_keras(node, layer, refused)
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
    prefix = "kmix>float32_"
    if isinstance(activation, dict) and isinstance(activation.get("config"), str):
        name = activation["config"]
        return name[len(prefix):] if name.startswith(prefix) else None
    return None


def _float32():
    """Keras's `float32` policy as a saved config holds it."""
    return keras.saving.serialize_keras_object(keras.DTypePolicy("float32"))


def _is_kmix(node):
    module, registered = node.get("module"), node.get("registered_name")
    return (isinstance(module, str) and module.split(".")[0] == "kmix") or (
        isinstance(registered, str) and registered.startswith("kmix>")
    )


def _as_keras(node, layer, refused):
    """Keras's counterpart of one serialized kmix object, or the object itself, its refusal recorded."""
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
        fused = not any(kwargs.get("return_attention_scores") for kwargs in calls) and (
            query is None or len(query) == 3
        )
        inner["dropout"] = 0.0
        if not fused:
            inner["dtype"] = _float32()
        return {**node, "module": "keras.layers", "registered_name": None, "config": inner}
    refused.append(f"{name} ({where})")
    return node
