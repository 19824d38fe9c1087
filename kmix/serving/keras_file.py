"""The `.keras` file `kmix.export` writes: one that Keras alone loads, kmix's objects written as Keras's own.

The placed copy `kmix.export` serves holds kmix's classes and policies;
saved as they are, a process loading the file would need kmix. The file is
written with Keras's counterparts instead, chosen to compute as kmix's do:

- a layer under `HalfStoragePolicy` (float32 compute, half variables) is
  written under Keras's `float32` policy. Its weights stay half in the
  file, and `keras.models.load_model` assigns them to float32 variables
  exactly (every half value is a float32 one): the same arithmetic, with
  that layer's variables in float32 in memory. Keras has no policy that
  stores half and computes float32.
- a layer handing float32 out from a half matmul (its activation a
  `kmix.ops.float32_out` one: the model's output layers) is written with
  Keras's plain activation under `float32` (its weights half in the file).
- `kmix.layers.Softmax` (a float32 softmax handing back the half compute
  dtype) becomes Keras's `Softmax` under `float32`: the same softmax, its
  output float32 (the next layer casts it to its compute dtype).
- `kmix.layers.MultiHeadAttention` becomes Keras's `MultiHeadAttention` in
  the half dtype: on TensorFlow, Keras's fused path
  (`keras.ops.dot_product_attention`) computes the softmax in float32, as
  kmix's does. Keras takes that path without dropout, without returned
  scores and for queries of rank 3, so its `dropout` is written as 0
  (dropout does nothing when serving), and a layer called with
  `return_attention_scores` or attending over more axes is written in
  float32 (its weights still half in the file).

A fully masked row then gives Keras's result (uniform over the keys, as
the float32 model gives), not kmix's zeros. Any other kmix object
(`MaskedSoftmax`, `WithPolicy`, `Remat`, an `attention_bias` argument) has
no Keras counterpart: the file is refused before anything is written.
"""

import copy
import json
import os
import tempfile
import zipfile

import keras

from kmix._tree import walk
from kmix.ops import float32_out
from kmix.placing.reload import user_classes

_CONFIG = "config.json"


def keras_config(model, path):
    """The config `model.save` writes for `model`, with kmix's objects written as Keras's (see the module).

    Raises:
        ValueError: naming the layers, where the model holds a kmix object
            that Keras has no counterpart for; nothing is written.
    """
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
    """Raises before anything is written where the file cannot be made, or Keras could not rebuild it.

    The rewritten config alone is rebuilt, as `load_model` rebuilds it (a
    Keras LSTM under bfloat16 fails there: its orthogonal initializer's QR
    has no bfloat16 kernel).
    """
    config = keras_config(model, path)
    try:
        with keras.saving.custom_object_scope(user_classes(model)):
            keras.saving.deserialize_keras_object(config, safe_mode=False)
    except Exception as error:  # noqa: BLE001  reported with Keras's own reason
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
    """The ids of `model`'s layers that the file may write under `float32` by design.

    A layer computing in float32 on half weights (`HalfStoragePolicy`), and
    kmix's `Softmax` or `MultiHeadAttention` (with the layers inside it),
    which the file writes as Keras's in float32: `load_model` gives them
    float32 compute and variables.
    """
    found = set()
    for _, layer, _ in walk(model):
        if (layer.compute_dtype == "float32" or type(layer).__module__.split(".")[0] == "kmix"
                or float32_out.is_wrapped(getattr(layer, "activation", None))):
            found.update([id(layer)] + [id(inner) for _, inner, _ in walk(layer)])
    return found


def rewrite(config):
    """`(config, refused)`: a saved model config with kmix's objects written as Keras's, and those left.

    Args:
        config: a config as `keras.saving.serialize_keras_object` gives it
            (nested dicts of `module`, `class_name`, `config`, ...).

    Returns:
        A new config, and `refused`: a line for each kmix object with no
        Keras counterpart ("MaskedSoftmax (layer 'scores')").
    """
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
