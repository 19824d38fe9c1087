"""`kmix.export(model, path)`: place, write beside the path, read back and check against float32, move in."""

import contextlib
import gc
import os
import time
import warnings

import keras
import tensorflow as tf

from kmix._output import progress
from kmix.placing import autocast
from kmix._tree import digest, walk
from kmix.policy.policy import Policy
from kmix import _checks, _compat, _preserved
from kmix.serving import artifact, check, destination, half_weights

_HALF = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "f16": "float16"}


@_compat.releases_custom_gradients
def export(model, filepath, dtype="bfloat16", sample=None, float32_layers=None, verbose=True, overwrite=False):
    """Writes a half-precision serving artifact of `model`, checked against its float32 outputs.

    A SavedModel directory, or a `.keras` file Keras alone loads; weights in `dtype`, float32 in and out;
    written beside the path and checked on `sample` before it is moved in; `model` is left as it was.

    Args:
        model: a built `keras.Model`, in float32 or already placed by `kmix.autocast`.
        filepath: a directory for a SavedModel, a path ending in `.keras`, or a list of them (one check,
            every artifact written); not `.h5`.
        dtype: `"bfloat16"` (the default: float32's range) or `"float16"`.
        sample: inputs to check on, as the model takes them (arrays, tensors, lists / dicts of them, or a
            `tf.data.Dataset`), at least one row; by default drawn from the input specs.
        float32_layers: layer names, paths or classes to keep in float32, as `kmix.autocast` takes them.
        verbose: print progress and the report.
        overwrite: by default `filepath` must be new or an empty directory; True replaces an artifact there
            (moved in whole), keeping other files. A file never replaces a directory, nor the reverse.

    Returns:
        An `ExportReport`: paths, the largest difference from float32, top-1 agreement, bytes, load time.

    Raises:
        TypeError / ValueError: naming the argument that does not fit (model, path, `dtype`, `sample`).
        kmix.serving.NotFiniteError: half outputs not finite; its `float32_layers` are what to pass to retry.

    Example:

    >>> report = kmix.export(model, "serving/1", sample=x_val[:64])
    >>> probs = tf.saved_model.load("serving/1").serve(x_val[:8])  # float32 in, float32 out
    """
    targets, half = _check_paths(filepath, overwrite), _check_dtype(dtype)
    _checks.built_model(model)
    say = progress if verbose else (lambda message: None)
    x, origin = check.inputs_to_check(model, sample)
    run = _export_copy if any(artifact.kind(target.given) == "keras" for target in targets) else _export_in_place
    report = run(model, targets, half, x, origin, float32_layers, say)
    if verbose:
        print(report)
    return report


def _export_in_place(model, targets, half, x, origin, float32_layers, say):
    """SavedModels of `model` placed in place and served with half weights; the one half run is the artifact's."""
    with _preserved.Preserved(model, saved="none") as kept:
        placed = not _computes_in_float32(model)
        if placed:
            _autocast(model, Policy("O0"), None)  # for the float32 outputs, then put back
        try:
            expected = _finite_float32(check.outputs(model, x), model)
        finally:
            if placed:
                kept.restore_layers()
        say(f"kmix.export: placing {model.name!r} ({half}, in place for the export)")
        _autocast(model, Policy("O1", half=half), float32_layers)
        weights, signature = half_weights.HalfWeights(model, half), artifact.input_signature(model, model, x)
        traced = contextlib.ExitStack()  # the trace's gradient registrations would hold it and the half weights
        traced.enter_context(_compat.releasing_custom_gradients())
        serve = tf.function(weights.call, input_signature=signature, autograph=False)  # traced once, on write
        written = [digest(v) for v in weights.variables()]
        sizes, stored, kept_float32 = weights.bytes(), weights.stored_in_half, weights.kept_float32

        def write(to):
            with weights.serving():
                artifact.write_function(serve, signature, to, weights.variables())

        def release():  # the half weights, before the artifact's own are read back
            nonlocal weights, serve
            weights = serve = None
            traced.close()
            gc.collect()

        def verify(to, path):
            begin = time.perf_counter()
            predict, stored_weights = artifact.read_saved_model(to)
            loaded_s = time.perf_counter() - begin
            if stored_weights is None or [digest(v) for v in stored_weights] != written:
                raise ValueError(f"kmix.export wrote {path}, but read back its weights are not the {half} weights "
                                 "it wrote, and it was removed.")
            say("kmix.export: checking it against float32 on the sample")
            result = check.Comparison(expected, predict(x))
            if not result.finite:
                kept.restore_layers()
                reference = model if _computes_in_float32(model) else _autocast(model, Policy("O0"), None)
                raise check.refuse(result, reference, x, half, float32_layers)
            return result, loaded_s

        done = _write_checked(targets, write, verify, say, release)
        return _report(half, origin, done, sizes, stored, kept_float32, model)  # inside: `model` still placed


def _export_copy(model, targets, half, x, origin, float32_layers, say):
    """`.keras` files (and SavedModels beside them): a placed copy of `model`, its weights stored half."""
    say(f"kmix.export: placing a {half} copy of {model.name!r}")
    served = _placed_copy(model, Policy("O2", half=half), float32_layers)
    stored, kept = half_weights.store_in_half(served, half)
    reference = model if _computes_in_float32(model) else _placed_copy(model, Policy("O0"), None)
    say("kmix.export: checking it against float32 on the sample")
    expected = _finite_float32(check.outputs(reference, x), model)
    before = check.Comparison(expected, check.outputs(served, x))
    if not before.finite:
        say("kmix.export: non-finite outputs in half precision; diagnosing")
        raise check.refuse(before, reference if reference is not model else _placed_copy(model, Policy("O0"), None),
                           x, half, float32_layers)
    for path in [target.given for target in targets if artifact.kind(target.given) == "keras"]:
        artifact.check_keras_file(served, path)

    def verify(to, path):  # refused beyond 4x the written model's difference from float32
        predict, seconds = artifact.load(to, served)
        result = check.Comparison(expected, predict(x))
        if not result.finite or result.max_abs_diff > 4 * before.max_abs_diff + 1e-6 * before.max_abs_float32:
            raise ValueError(f"kmix.export wrote {path}, but read back it is {result.max_abs_diff:.4g} from float32 "
                             f"where the model it wrote is {before.max_abs_diff:.4g}: it does not compute as that "
                             "model does, and was removed." + (" A saved config does not rebuild this model as it "
                             "is: export to a SavedModel directory (a path not ending in .keras)."
                             if artifact.kind(path) == "keras" else ""))
        return result, seconds

    done = _write_checked(targets, lambda to: artifact.write(served, to, x, model), verify, say)
    return _report(half, origin, done, half_weights.weight_bytes(served), stored, kept, served)


def _write_checked(targets, write, verify, say, release=None):
    """`{path: (Comparison, seconds, bytes on disk)}`: each written by `write(to)`, checked by `verify(to, path)`,
    moved in; on any exception its partial artifact is discarded. `release()` runs before checking the last."""
    done = {}
    for target in targets:
        say(f"kmix.export: writing {target.given}")
        committed = False
        try:
            write(target.partial)
            if release is not None and target is targets[-1]:
                release()
            say(f"kmix.export: reading {target.given} back")
            result, seconds = verify(target.partial, target.given)
            disk = artifact.disk_bytes(target.partial)  # the artifact's own files, not others at the path
            target.commit()
            committed = True
        finally:
            if not committed:
                target.discard()
        done[target.given] = (result, seconds, disk)
    return done


def _report(half, origin, done, sizes, stored, kept, served):
    """The `ExportReport` of `done` (`_write_checked`'s), with the figures of the artifact furthest from float32."""
    worst = max((result for result, _, _ in done.values()), key=lambda r: r.max_abs_diff)
    return check.ExportReport(
        paths=list(done), dtype=half, sample=origin, max_abs_diff=worst.max_abs_diff,
        max_abs_float32=worst.max_abs_float32, top1_agreement=worst.top1_agreement, weight_bytes=sizes[0],
        float32_weight_bytes=sizes[1], disk_bytes={path: d for path, (_, _, d) in done.items()},
        load_seconds={path: s for path, (_, s, _) in done.items()}, stored_in_half=stored, kept_float32=kept,
        float32_layers=[p for p, layer, _ in walk(served) if layer.compute_dtype == "float32" and layer.weights])


def _finite_float32(expected, model):
    """`expected`, `model`'s float32 outputs on the sample; refused where not finite (nothing to check against)."""
    if not check.all_finite(expected):
        raise ValueError(f"`sample` gives non-finite outputs in float32 already (model {model.name!r}): there is "
                         "nothing to check the half model against. Pass inputs the model was trained on.")
    return expected


def _autocast(model, policy, float32_layers):
    """`kmix.autocast(model, policy)` in place, its advice on reloading the model silenced (it is for training)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="kmix.autocast placed ")
        return autocast(model, policy, float32_layers=float32_layers)


def _placed_copy(model, policy, float32_layers):
    """`kmix.autocast(model, policy, copy=True)`, its error worded for `export` where the model cannot be copied."""
    try:
        return autocast(model, policy, float32_layers=float32_layers, copy=True)
    except ValueError as e:
        if "copy=True" not in str(e):
            raise
        cause = e.__cause__ or e
        raise ValueError(f"kmix.export writes a placed copy of model {model.name!r} and leaves the model as it is, "
                         "but the model cannot be copied as `model.save` and `keras.models.load_model` copy it: "
                         f"{type(cause).__name__}: {str(cause).strip().splitlines()[0][:300]} A subclassed model's "
                         "`__init__` must take `**kwargs` and pass them to `super().__init__`, and `get_config` must "
                         "return its other arguments.") from e


def _computes_in_float32(model):
    """Whether every layer of `model` computes in float32 with float32 (or non-float) variables."""
    half = any(keras.backend.standardize_dtype(v.dtype) in ("float16", "bfloat16") for v in model.weights)
    return not half and all(layer.compute_dtype == "float32" for _, layer, _ in walk(model))


def _check_paths(filepath, overwrite):
    """A `destination.Target` for each path, checked (and leftovers of killed exports cleaned) at the call."""
    _checks.boolean("overwrite", overwrite)
    paths = list(filepath) if isinstance(filepath, (list, tuple)) else [filepath]
    if not paths:
        raise ValueError("`filepath` must name at least one artifact. Received: filepath=[].")
    for path in paths:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise TypeError(f"`filepath` must be a path (a str or os.PathLike): a directory for a SavedModel, or a "
                            f"file ending in '.keras'. Received: filepath={path!r} (of type {type(path).__name__}).")
        if str(path).lower().endswith((".h5", ".hdf5")):
            raise ValueError("`filepath` must be a directory for a SavedModel or a file ending in '.keras'; "
                             "kmix.export writes no HDF5 file (Keras's legacy format keeps no half policies). "
                             f"Received: filepath={str(path)!r}.")
    targets = []
    for path in paths:  # a loop, not a comprehension: a warning's stacklevel points at the caller's line
        targets.append(destination.Target(str(path), overwrite))
    if len({t.path for t in targets}) < len(targets):
        raise ValueError(f"`filepath` names one path twice. Received: filepath={filepath!r}.")
    return targets


def _check_dtype(dtype):
    half = _HALF.get(dtype) if isinstance(dtype, str) else None
    if half is None:
        raise ValueError("`dtype` must be the half dtype to store and compute in: 'bfloat16' (float32's range; fast "
                         "on CPUs with AVX512_BF16 / AMX and on GPUs from compute capability 8.0) or 'float16'. "
                         f"Received: dtype={dtype!r}")
    return half
