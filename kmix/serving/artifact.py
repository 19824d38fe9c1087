"""Writing and reading back `kmix.export`'s artifacts: a SavedModel with a `serve` endpoint, or a `.keras` file.

The SavedModel is what Keras's `model.export(path, format="tf_saved_model")`
writes (a `keras.export.ExportArchive` with one endpoint, `serve`, also the
`serving_default` signature), with three differences: its floating inputs
are float32 whatever the model's first layers compute in; its floating
outputs are cast to float32 where the model returns a half tensor (a
keras-hub task whose last layer is a block); and each variable is stored
once, where Keras 3.15's export stores every variable twice
(keras-team/keras#23553), so the reloaded object has no `variables`
attribute (it serves; it does not train).
"""

import os
import pathlib
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from kmix.placing.reload import differences, reloaded, user_classes
from kmix.placing.trace import input_specs


def kind(path):
    """`"keras"` for a path ending in `.keras`, else `"tf_saved_model"` (a directory)."""
    return "keras" if str(path).endswith(".keras") else "tf_saved_model"


def write(model, path, sample):
    """Writes `model` to `path` (see `kind`); `sample` gives the serving signature where the model does not."""
    if kind(path) == "keras":
        model.save(path)
        return
    specs = input_specs(model) or input_specs(model, sample)
    signature = keras.tree.map_structure(
        lambda s: tf.TensorSpec(s.shape, tf.float32 if s.dtype.is_floating else s.dtype), specs
    )

    def serve(x):
        return keras.tree.map_structure(_to_float32, model(x, training=False))

    archive = keras.export.ExportArchive()
    # No `archive.track(model)`: the endpoint tracks the variables it reads itself, and tracking the
    # model as well stores every variable a second time (keras-team/keras#23553).
    archive.add_endpoint("serve", serve, input_signature=[signature])
    archive.write_out(path, verbose=False)


def check_rebuilds(model, path):
    """Raises before anything is written where `keras.models.load_model` could not rebuild `model`.

    The config alone is rebuilt, as `load_model` rebuilds it (a Keras LSTM
    under bfloat16 fails there: its orthogonal initializer's QR has no
    bfloat16 kernel).
    """
    _, error = reloaded(model)
    if error is not None:
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise ValueError(
            f"kmix.export cannot write {path}: `keras.models.load_model` could not rebuild the half-precision "
            f"model from its config ({type(error).__name__}: {first}). Nothing was written. Export to a "
            "SavedModel directory instead (a path not ending in .keras), which serves the model as it is."
        )


def load(path, model):
    """`(predict, seconds)`: the artifact at `path` read back, as a function of the inputs, and the time it took.

    A `.keras` file loads with `keras.models.load_model` (`model`'s own
    classes in scope, as `kmix.autocast` copies them); a SavedModel with
    `tf.saved_model.load`, its `serve` endpoint called.
    """
    start = time.perf_counter()
    if kind(path) == "keras":
        with keras.saving.custom_object_scope(user_classes(model)):
            loaded = keras.models.load_model(path, compile=False, safe_mode=False)
        predict = lambda x: loaded(x, training=False)  # noqa: E731
        moved = [f"{path} (compute {mine[1]}, variables {mine[2]} as written; {theirs[1]}, {theirs[2]} loaded)"
                 for _, path, mine, theirs, _ in differences(model, loaded).values()]
        if moved:
            warnings.warn(
                f"kmix.export wrote {path}, but `keras.models.load_model` rebuilds {len(moved)} of its layers "
                f"in other dtypes: {moved[:8]}. They compute there as Keras rebuilds them (their blocks or "
                "the model re-create them with a dtype of their own); the SavedModel serves the model as "
                "written.",
                stacklevel=3,
            )
    else:
        loaded = tf.saved_model.load(str(path))
        predict = lambda x: loaded.serve(_as_float32_inputs(x))  # noqa: E731
    return predict, time.perf_counter() - start


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
    return str(value)


def _to_float32(t):
    return tf.cast(t, tf.float32) if t.dtype.is_floating else t


def _as_float32_inputs(x):
    return keras.tree.map_structure(
        lambda t: tf.cast(t, tf.float32) if np.issubdtype(np.asarray(t).dtype, np.floating) else tf.convert_to_tensor(t),
        x,
    )
