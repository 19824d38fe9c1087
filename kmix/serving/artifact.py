"""Writing and reading back `kmix.export`'s artifacts: a SavedModel with a `serve` endpoint, or a `.keras` file.

The SavedModel is what Keras's `model.export(path, format="tf_saved_model")`
writes, but with float32 floating inputs and outputs, and each variable
stored once (Keras 3.15 stores every variable twice, keras-team/keras#23553).
"""

import os
import pathlib
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from kmix._tree import is_graph_model
from kmix.placing.twin import differences, user_classes
from kmix.placing.trace import input_specs
from kmix.serving import keras_file


def kind(path):
    """`"keras"` for a path ending in `.keras`, else `"tf_saved_model"` (a directory)."""
    return "keras" if str(path).endswith(".keras") else "tf_saved_model"


def write(served, path, sample, model):
    """Writes `served` to `path` (see `kind`), its inputs named as Keras names `model`'s (else from `sample`)."""
    if kind(path) == "keras":
        keras_file.write(served, path)
        return

    def serve(*args):
        return keras.tree.map_structure(_to_float32, served(*args, training=False))

    archive = keras.export.ExportArchive()
    # No `archive.track(served)`: the endpoint tracks the variables it reads itself, and tracking the
    # model as well stores every variable a second time (keras-team/keras#23553).
    archive.add_endpoint("serve", serve, input_signature=input_signature(model, served, sample))
    archive.write_out(path, verbose=False)


def write_function(serve, signature, path, variables):
    """Writes `serve` (a function of `signature`) as a SavedModel's `serve` endpoint at `path`, tracking `variables`."""
    archive = keras.export.ExportArchive()
    archive.add_variable_collection("weights", list(variables))
    archive.add_endpoint("serve", serve, input_signature=signature)
    archive.write_out(path, verbose=False)


def input_signature(model, served, sample):
    """The `serve` endpoint's specs as Keras's `model.export` gives them: named after the inputs, floats float32.

    A functional model takes one argument (the structure of its inputs), a
    Sequential one per input, a subclassed model the structure of `sample`, unnamed.
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
        predict = lambda x: loaded(x, training=False)  # noqa: E731
        float32 = keras_file.written_in_float32(model)
        moved = [f"{path} (compute {mine[1]}, variables {mine[2]} as written; {theirs[1]}, {theirs[2]} loaded)"
                 for layer, path, mine, theirs, _ in differences(model, loaded).values()
                 if not (id(layer) in float32 and tuple(theirs[1:3]) == ("float32", "float32"))]
        if moved:
            warnings.warn(
                f"kmix.export wrote {path}, but `keras.models.load_model` rebuilds {len(moved)} of its layers "
                f"in other dtypes: {moved[:8]}. They compute there as Keras rebuilds them (their blocks or "
                "the model re-create them with a dtype of their own); the SavedModel serves the model as "
                "written.",
                stacklevel=3,
            )
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
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def variables_bytes(path):
    """The bytes of a SavedModel's `variables/` (its weights), or of a `.keras` file's weights entry."""
    path = pathlib.Path(path)
    if kind(path) == "keras":
        import zipfile

        with zipfile.ZipFile(path) as z:
            return sum(i.file_size for i in z.infolist() if i.filename.endswith(".h5"))
    return disk_bytes(path / "variables")


def check_path(name, value):
    """`value` as a path string; a clear error naming `name` otherwise."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise TypeError(
            f"`{name}` must be a path (a str or os.PathLike): a directory for a SavedModel, or a file "
            f"ending in '.keras'. Received: {name}={value!r} (of type {type(value).__name__})."
        )
    if str(value).lower().endswith((".h5", ".hdf5")):
        raise ValueError(
            f"`{name}` must be a directory for a SavedModel or a file ending in '.keras'; kmix.export writes "
            f"no HDF5 file (Keras's legacy format keeps no half policies). Received: {name}={str(value)!r}."
        )
    return str(value)


def _serving_spec(shape, dtype, name):
    dtype = tf.as_dtype(keras.backend.standardize_dtype(dtype))
    return tf.TensorSpec((None,) + tuple(shape)[1:], tf.float32 if dtype.is_floating else dtype, name=name)


def _to_float32(t):
    return tf.cast(t, tf.float32) if t.dtype.is_floating else t


def _as_float32_inputs(x):
    return keras.tree.map_structure(
        lambda t: tf.cast(t, tf.float32) if np.issubdtype(np.asarray(t).dtype, np.floating) else tf.convert_to_tensor(t),
        x,
    )
