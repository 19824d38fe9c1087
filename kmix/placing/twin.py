"""The twin: the placed model rebuilt from its config as `keras.models.load_model` rebuilds it, without weights.

`build` serializes the model once; `compare` reads what the model must take from its twin (`write.Edits`)
and what a reload places otherwise; `check` runs the twin on the model's own variables, reading only.
"""

import collections
import copy
import inspect
import os
import tempfile
import warnings

import keras
import numpy as np
import tensorflow as tf

from kmix import _compat
from kmix._tree import is_graph_model, own_weights, pair, resolved_policy, walk
from kmix.diagnose.data import sample_inputs
from kmix.placing import trace
from kmix.placing.write import Edits, is_constant

_OUT_OF_MEMORY = (MemoryError, tf.errors.ResourceExhaustedError)

Twin = collections.namedtuple("Twin", "model global_policy error")
Twin.__doc__ = """`build`'s twin (or None), the global policy object it was built under (held by its layers made
without `dtype=`), and the error that stopped it."""


class Verdict:
    """What the twin says of the placed model.

    Attributes:
        adopted: `{id(layer): (path, planned, twin's policy, has own weights)}`: as their blocks make them.
        unplaced: `{id(layer): (layer, path, in memory, after a reload)}`: placed by the global policy
            of the process that loads them (made without `dtype=`), where no one global rebuilds them.
        load_under: the global policy under which a reload rebuilds the model as placed, or None.
        error, unchecked: why Keras cannot build the model from its config; what stopped the check (memory).
        difference: the largest |model(x) - twin(x)| (0.0: bitwise equal; None: not checked).
        candidates: the layers given their twin's policy, until `check` reads which match it.
    """

    def __init__(self, error=None):
        self.adopted, self.unplaced, self.candidates = {}, {}, {}
        self.load_under, self.error, self.difference, self.unchecked = None, error, None, None


def build(model, layers=None, maps=None):
    """The `Twin` of `model` (`layers`: those inside it): serialized once, built without weights where Keras can.

    `maps`, a `renaming.TwinMaps`, makes the twin's policy maps (they foresee the layers a reload renames).
    """
    previous = keras.config.dtype_policy()
    sentinel, twin = keras.DTypePolicy(previous.name), None
    keras.config.set_dtype_policy(sentinel)
    scope = {**user_classes(model, layers), **(maps.custom_objects() if maps is not None else {})}
    try:
        with keras.saving.custom_object_scope(scope), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras's build warnings were shown when the model was made
            config, error = trace.attempt(_config, model)
            if error is None and maps is not None:
                maps.prepare(config)
            if error is None:
                twin, error = trace.attempt(_stateless, config)
            if error is not None and config is not None:  # a variable made from a constant: built with weights
                if maps is not None:
                    maps.made.clear()  # those of the build that failed
                twin, error = trace.attempt(keras.saving.deserialize_keras_object, config, safe_mode=False)
    finally:
        keras.config.set_dtype_policy(previous)
    return Twin(twin, sentinel, error)


def _config(model):
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    if isinstance(config.get("config"), dict) and any(
            "compile" in inspect.signature(c.__init__).parameters
            for c in type(model).__mro__ if "__init__" in vars(c) and c is not object):
        # keras-hub tasks compile themselves by default: an optimizer, whose variables a StatelessScope
        # refuses, would make the twin a build with weights.
        config["config"]["compile"] = False
    return config


def _stateless(config):
    with _compat.stateless():  # deserialization consumes its config: a copy
        return keras.saving.deserialize_keras_object(copy.deepcopy(config), safe_mode=False)  # the user's Lambdas


def run(twin, model, x):
    """`twin(x)` computed on `model`'s own variables (no copy), or None where they do not pair by position."""
    for ours, theirs in ((model.variables, twin.variables), (model.weights, twin.weights)):
        if len(ours) == len(theirs) and all(tuple(a.shape) == tuple(b.shape) for a, b in zip(ours, theirs)):
            with _compat.stateless(list(zip(theirs, ours))):
                return twin(x, training=False)
    return None  # a layer saved otherwise (a merged LoRA): not comparable


def differences(model, twin, rows=None):
    """`{id(layer): (layer, path, in memory, after a reload, twin)}` for each layer (the model too) placed otherwise."""
    found = {}
    for path, layer, _, other in pair(model, twin, by_path=True) if rows is None else rows:
        mine, got = describe(layer), describe(other) if other is not None else "no such layer"
        if mine != got:
            found[id(layer)] = (layer, path, mine, got, other)
    return found


def describe(layer):
    """`(class, compute dtype, variable dtype, own weights' dtypes as a set)`: what a reload must keep."""
    weights = tuple(sorted({keras.backend.standardize_dtype(v.dtype) for v in own_weights(layer)}))
    return type(layer).__name__, layer.compute_dtype, layer.variable_dtype, weights


def describe_policy(description):
    """`describe`'s tuple as the table shows it: "LayerNormalization mixed_float16"."""
    if isinstance(description, str):
        return description
    cls, compute, variable, _ = description
    return f"{cls} {compute if compute == variable else f'mixed_{compute}'}"


def compare(model, twin, half_policy):
    """Reads `model` beside its `twin`: `(Verdict, write.Edits)`. `half_policy`: the policy most layers are placed
    under; where the layers made without `dtype=` are all placed so, a reload under it rebuilds the model."""
    verdict = Verdict(twin.error)
    if twin.error is not None:
        return verdict, Edits()
    rows = pair(model, twin.model, by_path=True)
    found, by_global = differences(model, twin.model, rows), {}
    if half_policy != twin.global_policy.name:  # else a reload under this global places them so too
        by_global = {k: row for k, row in found.items() if getattr(row[4], "dtype_policy", None) is twin.global_policy}
    takers = [layer for _, layer, _, other in rows if other is not None and other.dtype_policy is twin.global_policy]
    if by_global and all(resolved_policy(layer).name == half_policy for layer in takers):
        verdict.load_under = half_policy
    verdict.unplaced = {k: row[:4] for k, row in by_global.items()}
    policies = []
    for key, (layer, path, _, _, other) in found.items():
        if key not in by_global and other is not None and type(other) is type(layer):
            policies.append((layer, resolved_policy(other).name))
            verdict.candidates[key] = (layer, other, path, resolved_policy(layer).name)
    pairs = [(a, b) for _, a, _, b in rows if b is not None and type(a) is type(b)]
    nodes, settings = _graph_edits(pairs)
    return verdict, Edits(policies, nodes, settings, _constant_edits(pairs))


def _graph_edits(pairs):
    """The functional graphs' nodes whose constant arguments, and operations whose plain settings, the twin's differ."""
    nodes, settings = [], []
    for ours, theirs in pairs:
        if not (_compat.is_functional(ours) and _compat.is_functional(theirs)):
            continue  # a Sequential's layers are its whole graph
        if len(_compat.graph_nodes(ours)) != len(_compat.graph_nodes(theirs)):
            continue
        for node, other_node in zip(_compat.graph_nodes(ours), _compat.graph_nodes(theirs)):
            operation, args, kwargs = _compat.node_call(node)
            other, other_args, other_kwargs = _compat.node_call(other_node)
            if isinstance(operation, keras.layers.Layer) or type(operation) is not type(other):
                continue  # a layer keeps its own state (`_constant_edits`)
            settings += [(operation, name, value) for name, value in vars(other).items()
                         if name != "name" and not name.startswith("_") and name in vars(operation)
                         and isinstance(value, (str, int, float, bool, type(None))) and vars(operation)[name] != value]
            try:
                new = keras.tree.map_structure(_rebuilt, (args, kwargs), (other_args, other_kwargs))
            except (TypeError, ValueError):
                continue  # not the same call structure: left as it is
            if any(a is not b for a, b in zip(keras.tree.flatten((args, kwargs)), keras.tree.flatten(new))):
                nodes.append((node, *new))
    return nodes, settings


def _rebuilt(ours, theirs):
    """The argument a node should call with: a constant as it was rebuilt, where it differs."""
    arrays = all(keras.ops.is_tensor(v) or isinstance(v, np.ndarray) for v in (ours, theirs))
    if isinstance(ours, keras.KerasTensor) or not arrays:
        return ours
    same = _dtype(ours) == _dtype(theirs) and np.array_equal(keras.ops.convert_to_numpy(ours),
                                                               keras.ops.convert_to_numpy(theirs))
    return ours if same else theirs


def _constant_edits(pairs):
    """The twin's layers' constant tensors (not variables) whose dtype the model's differ in."""
    return [(ours, name, value) for ours, theirs in pairs if not is_graph_model(ours)
            for name, value in vars(theirs).items()
            if is_constant(value) and is_constant(vars(ours).get(name)) and _dtype(vars(ours)[name]) != _dtype(value)]


def check(model, twin, verdict, specs, outputs=None):
    """Completes `verdict` once the edits are written, reading only (`outputs`: the model's, where known)."""
    verdict.adopted = {key: (path, before, resolved_policy(other).name, bool(own_weights(layer)))
                       for key, (layer, other, path, before) in verdict.candidates.items()
                       if describe(layer) == describe(other)}
    weighted = any(own_weights(row[0]) for row in verdict.unplaced.values())
    if twin.model is not None and specs is not None and not weighted:
        try:
            difference = _difference(model, twin.model, specs, outputs)
        except _OUT_OF_MEMORY as e:
            verdict.unchecked = e
            return verdict
        if not verdict.unplaced:
            verdict.difference = difference
        elif difference == 0:  # only weightless layers differ, and nothing they compute
            verdict.unplaced, verdict.load_under = {}, None
    if verdict.load_under:
        verdict.unplaced = {}
    return verdict


def _difference(model, twin, specs, ours=None):
    """The largest |model(x) - twin(x)| on `sample_inputs(specs)`, both on the model's variables."""
    ours, error = trace.call(model, specs) if ours is None else (ours, None)
    theirs, twin_error = (None, None) if error else trace.attempt(run, twin, model, sample_inputs(specs))
    if isinstance(error or twin_error, _OUT_OF_MEMORY):
        raise error or twin_error
    if error is not None or twin_error is not None:  # the model cannot run on made-up inputs; its twin cannot
        return None if error is not None else float("inf")
    if theirs is None:
        return None  # their variables do not pair
    worst = 0.0
    for a, b in zip(keras.tree.flatten(ours), keras.tree.flatten(theirs)):
        a, b = keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        if a.dtype != b.dtype or a.shape != b.shape:
            return float("inf")
        a, b = a.astype("float64"), b.astype("float64")
        gap = np.abs(a - b)[~((a == b) | (np.isnan(a) & np.isnan(b)))]
        if gap.size:
            worst = max(worst, float(np.max(np.where(np.isfinite(gap), gap, np.inf))))
    return worst


def warn(model, verdict, stacklevel):
    """One warning for what a reload would not rebuild as placed: which layers, and what to do."""
    lost = [f"{path} ({after}, planned {before})" for path, before, after, weighted in verdict.adopted.values()
            if weighted and _less_precise(before, after)]
    unplaced = [f"{path} ({describe_policy(mine)} in memory, {describe_policy(got)} after a reload)"
                for _, path, mine, got in verdict.unplaced.values()]
    if verdict.unchecked is not None:
        message = (f"it could not check that the model `keras.models.load_model` rebuilds predicts what it predicts "
                   f"({trace.first_words(verdict.unchecked)}, on a batch of 2 made-up inputs). The placement stands; "
                   "check a reload yourself on a small batch: `keras.models.load_model(path)(x)` against `model(x)`.")
    elif verdict.error is not None:
        message = (f"Keras cannot build it from its config ({trace.first_words(verdict.error)}), so `model.save` "
                   "will not load back as it is. Save its weights (`model.save_weights`) and build the model in "
                   "code, then autocast it again.")
    elif verdict.load_under is not None:
        message = ("some of its layers are made without `dtype=` (they take Keras's global policy when the model "
                   "is built or loaded), so `keras.models.load_model` rebuilds it as placed only under the global "
                   f"policy {verdict.load_under!r}: load it with `with kmix.policy_scope({verdict.load_under!r}): "
                   "model = keras.models.load_model(path)`.")
    elif unplaced:
        message = (f"`keras.models.load_model` would place {len(unplaced)} layers otherwise: {unplaced[:6]}"
                   f"{' ...' if len(unplaced) > 6 else ''}. Their blocks make them without passing their dtype on "
                   "(they take Keras's global policy when loaded), so a reloaded model computes there as Keras "
                   "builds it: after `load_model`, call `kmix.autocast` on it again.")
    elif lost:
        message = (f"its blocks make {len(lost)} layers with a dtype of their own, which a reload gives them "
                   f"again: {lost[:6]}{' ...' if len(lost) > 6 else ''}. They compute so in memory too, so that "
                   "the model you train is the model that reloads; to keep them in float32, change the block's "
                   "code, or wrap the block in `kmix.layers.WithPolicy`.")
    elif verdict.difference:
        message = (f"the model `keras.models.load_model` rebuilds from its config predicts up to "
                   f"{verdict.difference:.3g} away from it on the same weights (an operation of its graph or a "
                   "layer's own state computes otherwise when rebuilt). After `load_model`, call `kmix.autocast` "
                   "on it again, or load the saved weights (`model.save_weights`) into the model built in code.")
    else:
        return
    warnings.warn(f"kmix.autocast placed model {model.name!r}, but {message}", stacklevel=stacklevel)


def _less_precise(before, after):
    """Whether `after` loses float32 compute or variables `before` had (more precision, MMDiT's norms: no word)."""
    planned, got = keras.DTypePolicy(before), keras.DTypePolicy(after)
    return ((planned.compute_dtype == "float32" and got.compute_dtype != "float32")
            or (planned.variable_dtype == "float32" and got.variable_dtype != "float32"))


def user_classes(model, layers=None):
    """The model's own classes (unregistered ones included) by name; Keras's, keras-hub's and kmix's are registered."""
    layers = [layer for _, layer, _ in walk(model)] if layers is None else layers
    return {cls.__name__: cls for cls in {type(layer) for layer in layers} | {type(model)}
            if not cls.__module__.startswith(("keras.", "keras_hub.", "kmix."))}


def copy_model(model):
    """A copy of `model` as `keras.models.load_model` gives it back; ValueError where it cannot be saved and loaded."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")

        def save_and_load():
            model.save(path)
            with keras.saving.custom_object_scope(user_classes(model)):
                return keras.models.load_model(path, compile=False, safe_mode=False)

        copied, error = trace.attempt(save_and_load)
    if error is not None:
        raise ValueError(
            f"kmix.autocast(copy=True) copies a model as `model.save` and `keras.models.load_model` "
            f"do, and model {model.name!r} does not survive that: {type(error).__name__}: {error}. Place "
            "the model itself (copy=False, the default) and keep the float32 weights with "
            "`model.get_weights()` if you need them."
        ) from error
    for _, old, _, new in pair(model, copied):
        if isinstance(old, keras.layers.Lambda) and isinstance(new, keras.layers.Lambda):
            new.function = old.function  # the original object, with its closure
    return copied


def _dtype(value):
    return keras.backend.standardize_dtype(value.dtype)
