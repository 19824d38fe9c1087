"""The check of `kmix.export`'s artifact against the float32 model on a sample, and what it reports."""

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from kmix.diagnose import data, diagnose
from kmix.policy import Policy
from kmix.placing.trace import input_specs
from kmix._tree import walk

DRAWN_BATCH = 8  # items in a drawn sample
DRAWN_LENGTH = 16  # a drawn sample's length along the other axes the specs leave open


class NotFiniteError(ValueError):
    """`kmix.export` refused a model: its half-precision outputs are not finite on the sample.

    Attributes:
        float32_layers: the layers to keep in float32 (`kmix.export(..., float32_layers=...)`).
        diagnosis: the `kmix.Diagnosis`, or None where the diagnosis could not run.
    """

    def __init__(self, message, float32_layers, diagnosis):
        super().__init__(message)
        self.float32_layers, self.diagnosis = float32_layers, diagnosis


class Comparison:
    """The half model's outputs against the float32 model's on one sample.

    Attributes:
        max_abs_diff: the largest |half - float32| over every output value.
        max_abs_float32: the largest |float32 output|, to read the difference against.
        top1_agreement: for a single output with a last axis of 2 or more, how often the argmax agrees; else None.
        finite, float32_finite: whether every half output is finite where float32's is, and every float32 one.
    """

    def __init__(self, reference, half):
        ref = [np.asarray(t, np.float32) for t in keras.tree.flatten(reference)]
        got = [np.asarray(tf.cast(t, tf.float32)) for t in keras.tree.flatten(half)]
        self.float32_finite = all_finite(ref)
        self.finite = all(np.all(np.isfinite(g) | ~np.isfinite(r)) for r, g in zip(ref, got))
        diffs = [np.abs(g - r)[np.isfinite(r) & np.isfinite(g)] for r, g in zip(ref, got)]
        self.max_abs_diff = max((float(d.max()) for d in diffs if d.size), default=0.0)
        finite = [np.abs(r[np.isfinite(r)]) for r in ref]
        self.max_abs_float32 = max((float(f.max()) for f in finite if f.size), default=0.0)
        classes = len(ref) == 1 and ref[0].ndim >= 2 and ref[0].shape[-1] >= 2
        self.top1_agreement = float(np.mean(ref[0].argmax(-1) == got[0].argmax(-1))) if classes else None


@dataclasses.dataclass(repr=False, eq=False)
class ExportReport:
    """What `kmix.export` wrote and how far its outputs are from float32's; `str()` prints it.

    Attributes:
        paths: the artifacts written.
        dtype: the half dtype of the weights.
        sample: where the inputs checked came from, and their shapes.
        max_abs_diff, max_abs_float32, top1_agreement: the artifact's outputs
            against the float32 model's on the sample (`kmix.serving.Comparison`).
        weight_bytes, float32_weight_bytes: the variables as stored, and in float32.
        disk_bytes: `{path: bytes on disk}` of the artifact's own files.
        load_seconds: `{path: seconds to read it back}`.
        stored_in_half: the float32 layers storing half weights.
        float32_layers: every layer computing in float32.
        kept_float32: `{path: why}` for float32 layers with a matrix that keep float32 weights.
    """

    paths: list
    dtype: str
    sample: str
    max_abs_diff: float
    max_abs_float32: float
    top1_agreement: float
    weight_bytes: int
    float32_weight_bytes: int
    disk_bytes: dict
    load_seconds: dict
    stored_in_half: list
    float32_layers: list
    kept_float32: dict

    def __str__(self):
        top1 = "n/a" if self.top1_agreement is None else f"{self.top1_agreement:.1%}"
        lines = [f"kmix.export: {self.dtype} weights, float32 in and out; checked on a sample {self.sample}",
                 f"  max |out - float32|: {self.max_abs_diff:.4g} (largest |float32 out| {self.max_abs_float32:.4g}); "
                 f"top-1 = float32: {top1}",
                 f"  weights: {self.weight_bytes:,} bytes "
                 f"({self.weight_bytes / max(self.float32_weight_bytes, 1):.2f}x their float32 "
                 f"{self.float32_weight_bytes:,})",
                 f"  float32 compute: {len(self.float32_layers)} layers; of these storing {self.dtype}: "
                 f"{self.stored_in_half or 'none'}"]
        lines += [f"  float32 weights kept in {path}: {why}" for path, why in self.kept_float32.items()]
        lines += [f"  wrote {path}: {self.disk_bytes[path]:,} bytes, read back in {self.load_seconds[path]:.2f} s"
                  for path in self.paths]
        return "\n".join(lines)

    __repr__ = __str__


def all_finite(outputs):
    """Whether every value of `outputs` (a tensor, an array, or a structure of them) is finite."""
    return all(np.all(np.isfinite(np.asarray(t, np.float32))) for t in keras.tree.flatten(outputs))


def inputs_to_check(model, sample):
    """`(inputs, where they came from)`: `sample` (arrays, tensors, a dataset's first batch) or drawn from the specs."""
    if sample is None:
        specs = input_specs(model)
        if specs is None:
            raise ValueError(f"`sample` is needed for model {model.name!r}: it has no input specs to draw one from "
                             "(a subclassed model built from several inputs). Pass `sample=x`, a batch of inputs as "
                             "the model takes them.")
        vocab = min((layer.input_dim for _, layer, _ in walk(model) if isinstance(layer, keras.layers.Embedding)),
                    default=2)
        float32 = keras.tree.map_structure(
            lambda s: tf.TensorSpec(s.shape, tf.float32) if tf.as_dtype(s.dtype).is_floating else s, specs)
        x = data.sample_inputs(float32, DRAWN_BATCH, DRAWN_LENGTH, seed=0, vocab=vocab)
        return x, f"drawn from the input specs: {keras.tree.map_structure(lambda t: tuple(t.shape), x)}"
    if isinstance(sample, tf.data.Dataset):
        batch = next(iter(sample.take(1)), None)
        if batch is None:
            raise ValueError("`sample` is an empty tf.data.Dataset; kmix.export needs one batch of inputs.")
        sample, _, _ = keras.utils.unpack_x_y_sample_weight(batch) if isinstance(batch, tuple) else (batch, None, None)
    leaves = keras.tree.flatten(sample)
    if not leaves or not all(isinstance(t, (np.ndarray, tf.Tensor)) or hasattr(t, "__array__") for t in leaves):
        raise TypeError("`sample` must be a batch of inputs as the model takes them: NumPy arrays or tensors (or a "
                        "list / dict of them), or a tf.data.Dataset. "
                        f"Received: sample of type {type(sample).__name__}.")
    shapes = keras.tree.map_structure(lambda t: tuple(np.shape(t)), sample)
    if any(len(np.shape(t)) == 0 or np.shape(t)[0] == 0 for t in leaves):
        raise ValueError("`sample` must hold at least one row of inputs, batch axis first: kmix.export checks the "
                         f"half model against float32 on it. Received: sample with shapes {shapes}.")
    return _as_input_dtypes(model, sample), f"given: {shapes}"


def _as_input_dtypes(model, sample):
    """`sample` with each integer input in the dtype the model's input takes; what cannot be refused naming `sample`."""
    specs, leaves = input_specs(model), keras.tree.flatten(sample)
    wanted = [] if specs is None else keras.tree.flatten(specs)
    if len(leaves) != len(wanted):
        return sample  # no specs (the signature is the sample's own), or a structure checked where the model runs
    converted = []
    for leaf, spec in zip(leaves, wanted):
        value, target = np.asarray(leaf), spec.dtype.as_numpy_dtype
        if spec.dtype.is_integer and value.dtype != target:
            if not np.issubdtype(value.dtype, np.integer) or (
                value.size and (value.min() < np.iinfo(target).min or value.max() > np.iinfo(target).max)):
                low, high = (value.min(), value.max()) if value.size else ("", "")
                raise ValueError(f"`sample` must hold {spec.dtype.name} values where model {model.name!r} takes "
                                 f"{spec.dtype.name} inputs (token ids). Received: sample of dtype "
                                 f"{value.dtype.name} (values {low} to {high}).")
            leaf = value.astype(target)
        elif spec.dtype.is_floating and value.dtype.kind in "iu":
            leaf = value.astype(np.float32)
        elif (spec.dtype.is_floating and value.dtype.kind != "f") or (spec.dtype.is_bool and value.dtype.kind != "b"):
            accepted = "real numbers (a float or integer array)" if spec.dtype.is_floating else "bool values"
            raise ValueError(f"`sample` must hold {accepted} where model {model.name!r} takes {spec.dtype.name} "
                             f"inputs. Received: sample of dtype {value.dtype.name}, shape {value.shape}.")
        converted.append(leaf)
    return keras.tree.pack_sequence_as(sample, converted)


def outputs(model, x):
    """`model(x, training=False)`; a clear error naming `sample` where `x` does not fit."""
    return data.forward(model, x, argument="sample")


def refuse(comparison, reference, x, half, float32_layers):
    """The `NotFiniteError` for a half model, naming the layers `kmix.diagnose` finds overflowing on `reference`."""
    diagnosis = None
    try:
        reference.compile(optimizer="sgd", loss="mse")  # a float32 model; its gradients of a squared error
        y = keras.tree.map_structure(lambda t: np.zeros(t.shape, np.float32), outputs(reference, x))
        diagnosis = diagnose(reference, x, y, policy=Policy("O1", half=half), batches=1,
                             batch_size=len(keras.tree.flatten(y)[0]), float32_layers=float32_layers)
        found = list(diagnosis.float32_layers)
        rows = [f"  {row.path} ({row.class_name}): max |out| {row.output.max_abs:.3g} in float32, {row.verdict}"
                for row in diagnosis.layers if row.verdict not in ("", "ok")]
        why = "kmix.diagnose finds (the whole diagnosis is the error's `diagnosis`):\n" + "\n".join(rows)
    except Exception as e:  # noqa: BLE001  diagnose failing on the user's layers: the refusal stands, unnamed
        found, why = [], f"kmix.diagnose could not run ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    keep = sorted(set(float32_layers or ()) | set(found))
    advice = (f"Keep them in float32: kmix.export(model, path, dtype={half!r}, float32_layers={keep!r})"
              if found else "Pass the layers to keep in float32 as `float32_layers`, or use dtype='bfloat16' "
              "(float32's range)")
    return NotFiniteError(f"kmix.export refused to write: the {half} model's outputs are not finite on the sample "
                          f"where the float32 model's are (largest |float32 output| {comparison.max_abs_float32:.4g}). "
                          f"Layers to keep in float32: {found or 'not found'}; {why}\n{advice}.", keep, diagnosis)
