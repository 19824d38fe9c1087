"""The float32 islands a diagnosis of one batch advises, for `kmix.autocast(sample=...)`.

Non-finite values from the first failing layer hide any later one, so `advise` diagnoses again with what
it found kept in float32, at most `ROUNDS` times, until nothing new is found or nothing is non-finite.
"""

import collections

import keras
import tensorflow as tf

from kmix.diagnose.core import diagnose
from kmix._tree import is_auto_named, walk

ROUNDS = 4  # diagnoses at most, each keeping in float32 what the ones before found
_ACCEPTED = ("a batch `(x, y)` as `model.fit` takes one (arrays or tensors, or lists / dicts of them), "
             "or a tf.data.Dataset of `(x, y)` or `(x, y, sample_weight)` batches (its first batch is used)")
_NOT_A_CAUSE = ("FIRST NON-FINITE", "non-finite from upstream", "non-finite in float32", "kept", "ok")

# What a diagnosis advises: `targets` `{layer name or path: finding}`, `initial_scale`, the inputs `x`.
Advice = collections.namedtuple("Advice", "targets initial_scale x")


def advise(model, policy, sample):
    """The `Advice` of `kmix.diagnose` for the compiled float32 `model` on `sample` under `policy` (None: float32)."""
    x, y = check_sample(sample)
    if policy.compute_dtype == "float32":
        return None
    if not getattr(model, "compiled", False) or getattr(model, "loss", None) is None:
        raise ValueError("`sample` runs kmix.diagnose, which differentiates the model's loss: compile the float32 "
                         f"model with its loss first. Received: model {model.name!r}, "
                         + ("compiled without a loss." if getattr(model, "compiled", False) else "not compiled.")
                         + " For example `model.compile(optimizer='adam', loss=...)`, then "
                         "`kmix.autocast(model, level, sample=(x, y))`.")
    if isinstance(x, tf.data.Dataset):
        args = dict(x=x, y=None, batches=1)
        x = keras.utils.unpack_x_y_sample_weight(next(iter(x)))[0]
    else:
        args = dict(x=x, y=y, batches=1, batch_size=_length(x))
    targets, scale = {}, None
    for _ in range(ROUNDS):
        try:
            diagnosis = diagnose(model, policy=policy, float32_layers=list(targets) or None, **args)
        except (TypeError, ValueError) as e:
            raise type(e)(f"`sample` could not be diagnosed: {e}") from e
        scale = diagnosis.recommended_scale if scale is None else scale
        found = {t: why for t, why in _targets(model, diagnosis).items() if t not in targets}
        targets.update(found)
        if not found or diagnosis.first_nonfinite_layer is None:
            break
    return Advice(targets, scale, x)


def _targets(model, diagnosis):
    """`{layer name or path: the finding}` to keep in float32.

    The diagnosis names the outermost addressable layer (a keras-hub block); where the cause lies on layers
    inside it that keep their names in a reload (T5's attentions), those are kept by path, else the block.
    """
    by_path = {path: layer for path, layer, _ in walk(model)}
    causes = {}  # diagnosis row path -> (its target name, the cause it names)
    for row in diagnosis.layers:
        words = [w for w in row.verdict.split(", ") if w not in _NOT_A_CAUSE]
        if words:
            causes[row.path] = (row.target, words[-1])
    targets = {}
    for name in diagnosis.float32_layers:
        block_path = next((p for p, layer in by_path.items() if layer.name == name), None)
        flagged = [(p, cause) for p, (target, cause) in causes.items() if target == name]
        inner = [(p, cause) for p, cause in flagged if p != block_path and _addressable(by_path, block_path, p)]
        if inner:
            targets.update(inner)
            continue
        p, cause = flagged[0] if flagged else (None, "overflows")
        targets[name] = cause if p in (None, block_path) else f"{cause} at {p}"
    return targets


def _addressable(by_path, block_path, path):
    """Whether `path` lies in the block and keeps its name in a copy (no layer on the way auto-named)."""
    if block_path is None or not path.startswith(block_path + "/"):
        return False
    parts = path.split("/")
    ways = ["/".join(parts[: i + 1]) for i in range(len(block_path.split("/")), len(parts))]
    return all(way in by_path and not is_auto_named(by_path[way]) for way in ways)


def check_sample(sample):
    """`(x, y)` from `sample`, or `(dataset, None)`; a `TypeError` / `ValueError` naming `sample` otherwise."""
    if isinstance(sample, tf.data.Dataset):
        return sample, None
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        length = f" of length {len(sample)})." if isinstance(sample, (tuple, list)) else ")."
        shown = repr(sample) if len(repr(sample)) <= 80 else repr(sample)[:77] + "..."
        raise TypeError(f"`sample` must be {_ACCEPTED}. Received: sample={shown} (of type {type(sample).__name__}"
                        + length)
    x, y = sample
    if x is None or y is None:
        raise ValueError("`sample` must hold the inputs and the targets, `(x, y)`: the diagnosis differentiates the "
                         f"loss to advise the initial loss scale. Received: sample=({'None' if x is None else 'x'}, "
                         f"{'None' if y is None else 'y'}).")
    return x, y


def merge(float32_layers, names):
    """`float32_layers` (None, a class, a name, or a list of them) with `names` added."""
    given = as_list(float32_layers)
    return given + [name for name in names if name not in given] if names else float32_layers


def as_list(float32_layers):
    """`float32_layers` (None, a class, a name, or a list of them) as a list."""
    if float32_layers is None:
        return []
    return [float32_layers] if isinstance(float32_layers, (str, type)) else list(float32_layers)


def _length(x):
    leaves = keras.tree.flatten(x)
    if not leaves or not getattr(leaves[0], "shape", None):
        raise TypeError(f"`sample` must be {_ACCEPTED}. Received: an x without a batch dimension.")
    return int(leaves[0].shape[0])
