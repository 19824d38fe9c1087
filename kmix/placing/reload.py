"""What `keras.models.load_model` would make of a placed model, and making it the same.

A saved model keeps each layer's policy in that layer's config: a
Sequential or functional model lists its layers' configs, so a reload gives
each its own policy back. A block (a custom layer, a keras-hub transformer
layer) and a keras-hub backbone re-create their sublayers in their
constructor, with their own dtype: a reload gives those sublayers the
block's policy, whatever they had in memory. The check builds the model
from its config, as `load_model` does (under the global policy of the
moment, no weights loaded), and compares each layer. Where a block re-creates
a layer differently, the block (and the blocks around it, up to one whose
own config is saved) gets a `keras.dtype_policies.DTypePolicyMap` holding
every layer's policy by path, which Keras's layers and keras-hub's look
their policy up in as they are created (the mechanism keras-hub uses for
quantized layers). What still differs is reported.
"""

import os
import re
import tempfile
import inspect
import warnings

import keras

from kmix import _compat
from kmix._tree import is_auto_named, own_weights, pair, resolved_policy, snake_case, walk
from kmix.placing.rules import saved_layers


def reloaded(model, global_policy=None):
    """`model` built from its config as `load_model` builds it, without weights, or the error why not.

    The twin's variables have no storage (built in a `keras.StatelessScope`):
    `run` computes with it on the model's own variables. A model Keras cannot
    build so (a variable made from a constant) is built with weights.

    Args:
        model: a built model.
        global_policy: the Keras global dtype policy to load under (the one
            in force by default), which the layers a block makes without
            `dtype=` take.
    """
    previous = keras.config.dtype_policy()
    try:
        if global_policy is not None:
            keras.config.set_dtype_policy(global_policy)
        with keras.saving.custom_object_scope(user_classes(model)), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Keras's build warnings were shown when the model was made
            try:
                with _compat.stateless():  # no weights: `run` computes on the model's own
                    return _deserialize(model), None
            except Exception:  # noqa: BLE001  a layer that cannot be built statelessly: built with weights
                return _deserialize(model), None
    except Exception as e:  # noqa: BLE001  any failure here is reported, never raised from autocast
        return None, e
    finally:
        keras.config.set_dtype_policy(previous)


def _deserialize(model):
    """`model` built from its config (which Keras's deserialization consumes: made anew each time)."""
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    if _compiles_itself(type(model)) and isinstance(config.get("config"), dict):
        # keras-hub tasks compile themselves in their constructor by default: an optimizer, whose
        # variables a StatelessScope refuses (they start from a constant), would make the twin
        # fall back to a build with weights (+1x the model and its initializers).
        config["config"]["compile"] = False
    # safe_mode=False: a Lambda's function is the user's own, from this process.
    return keras.saving.deserialize_keras_object(config, safe_mode=False)


def _compiles_itself(cls):
    """Whether `cls`'s constructor takes `compile` (keras-hub's `Task`, reached through `**kwargs`)."""
    return any("compile" in inspect.signature(c.__init__).parameters
               for c in cls.__mro__ if "__init__" in vars(c) and c is not object)


def run(twin, model, x):
    """`twin(x)` computed on `model`'s own variables (no copy), or None where they do not pair.

    The variables pair by position, as `set_weights` pairs them: all the
    variables (seed states included) where both have as many, else the weights.
    """
    mapping = None
    for ours, theirs in ((model.variables, twin.variables), (model.weights, twin.weights)):
        if len(ours) == len(theirs) and all(tuple(a.shape) == tuple(b.shape) for a, b in zip(ours, theirs)):
            mapping = list(zip(theirs, ours))
            break
    if mapping is None:
        return None  # a layer saved otherwise (a merged LoRA): not comparable
    with _compat.stateless(mapping):
        return twin(x, training=False)


def differences(model, copy):
    """`{id(layer): (layer, path, in memory, after a reload)}` for each layer a reload places otherwise.

    The model itself is compared too (its policy sets the autocast scope of
    its call). Layers are matched by position in `walk` when both have as
    many, else by path.
    """
    found = {}
    for path, layer, _, twin in pair(model, copy, by_path=True):  # the model's own policy counts too
        mine = describe(layer)
        got = describe(twin) if twin is not None else "no such layer"
        if mine != got:
            found[id(layer)] = (layer, path, mine, got, twin)
    return found


def describe(layer):
    """`(class, compute dtype, variable dtype, own weights' dtypes)`: what a reload must keep.

    The dtypes as a set: a reload may hold fewer variables of the same dtypes
    (Keras saves a LoRA-enabled layer with its low-rank update merged).
    """
    weights = tuple(sorted({keras.backend.standardize_dtype(v.dtype) for v in own_weights(layer)}))
    return (type(layer).__name__, layer.compute_dtype, layer.variable_dtype, weights)


def record(model, found, copy):
    """Gives the blocks that re-create the layers in `found` a policy map of the whole placement.

    Returns:
        The blocks (and non-listing models) given a map: `write_maps` writes
        them anew after a later change of the placement.
    """
    listed = saved_layers(model)
    parents = {id(layer): parent for _, layer, parent in walk(model)}
    holders = {}
    for layer, *_ in found.values():
        if id(layer) in listed or layer is model:
            continue  # its own config is saved: no block re-creates it
        block = parents[id(layer)]
        while True:  # up to the first block whose own config is saved, or the model
            holders[id(block)] = block
            if block is model or id(block) in listed:
                break
            block = parents[id(block)]
    write_maps(model, list(holders.values()), copy)
    return list(holders.values())


def write_maps(model, holders, copy=None):
    """Gives each of `holders` a `DTypePolicyMap` of every layer's policy as placed now."""
    if not holders:
        return
    entries, default = _entries(model, copy), _default(model)
    for block in holders:
        # A map of the user's (a backbone built with one) is replaced on the block alone: its
        # layers keep reading theirs in memory, and the block's config carries the placement.
        dtype_map = keras.dtype_policies.DTypePolicyMap(default_policy=default)
        for path, policy in entries.items():
            dtype_map[path] = policy
        if block.path and block.path not in dtype_map:
            dtype_map[block.path] = resolved_policy(block)
        _set_map(block, dtype_map)


def _entries(model, copy):
    """`{key: policy}` for every layer: its path in memory and in `copy`, a pattern for auto-named ones.

    A layer a block makes without `name=` is named by Keras's counter
    (`t5_layer_norm_4`), which runs on in every reload (`t5_layer_norm_24`),
    and so are the paths of the layers inside it (`.../mixtral_sparse_moe_block_2/
    sparse_feedforward_gate_dense`). Such a layer is keyed by a pattern where
    each auto-named step of its path is its class's name with any counter,
    where every layer that pattern covers has one policy.
    """
    rows = pair(model, copy)[1:]  # the layers inside the model, with their twins
    by_path = {layer.path: layer for _, layer, _, twin in rows for layer in (layer, twin) if layer and layer.path}
    entries, patterns = {}, {}
    for _, layer, _, twin in rows:
        policy = resolved_policy(layer)
        for path in [p for p in (layer.path, getattr(twin, "path", None)) if p]:
            key = _path_pattern(path, by_path)
            if key is None:
                entries.setdefault(path, policy)
            else:
                patterns.setdefault(key, set()).add(policy.name)
    for key, names in patterns.items():
        if len(names) == 1:
            entries.setdefault(key, keras.DTypePolicy(names.pop()))
    return entries


def _path_pattern(path, by_path):
    """A regex for `path` with each auto-named step any count of its class, or None when none is."""
    steps = path.split("/")
    parts, auto = [], False
    for i, step in enumerate(steps):
        layer = by_path.get("/".join(steps[: i + 1]))
        if i > 0 and is_auto_named(layer):
            parts.append(f"{re.escape(snake_case(type(layer).__name__))}(?:_\\d+)?")
            auto = True
        else:
            parts.append(re.escape(step))
    return "/".join(parts) if auto else None


def copy_model(model):
    """A copy of `model` as `keras.models.load_model` gives it back: same class, config and weights.

    Raises:
        ValueError: naming the model, where it cannot be saved and loaded.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        try:
            model.save(path)
            with keras.saving.custom_object_scope(user_classes(model)):
                copy = keras.models.load_model(path, compile=False, safe_mode=False)
        except Exception as e:
            raise ValueError(
                f"kmix.autocast(copy=True) copies a model as `model.save` and `keras.models.load_model` "
                f"do, and model {model.name!r} does not survive that: {type(e).__name__}: {e}. Place "
                "the model itself (copy=False, the default) and keep the float32 weights with "
                "`model.get_weights()` if you need them."
            ) from e
    for _, old, _, new in pair(model, copy):
        if isinstance(old, keras.layers.Lambda) and isinstance(new, keras.layers.Lambda):
            new.function = old.function  # the original object, with its closure
    return copy


def user_classes(model):
    """The model's own classes (unregistered ones included) by the name their configs give.

    Keras's and keras-hub's classes are left to their registrations (a name such as
    "Add" is a merge layer and a `keras.ops` node); kmix's are registered.
    """
    return {
        cls.__name__: cls
        for cls in {type(layer) for _, layer, _ in walk(model)} | {type(model)}
        if not cls.__module__.startswith(("keras.", "keras_hub.", "kmix."))
    }


def _set_map(block, dtype_map):
    """Gives `block` the map as its own policy, in place of a map of the user's it may share.

    Keras's setter writes into a map the layer already holds (at the layer's
    path) rather than replacing it; a block sharing the user's map with its
    layers must hold the new one itself.
    """
    if isinstance(block.dtype_policy, keras.dtype_policies.DTypePolicyMap):
        block._dtype_policy = dtype_map  # noqa: SLF001  the setter would write into the shared map
    else:
        block.dtype_policy = dtype_map


def _default(model):
    """The policy most layers of `model` compute under: what a layer missing from a map takes."""
    counts = {}
    for _, layer, _ in walk(model):
        name = resolved_policy(layer).name
        counts[name] = counts.get(name, 0) + 1
    return keras.DTypePolicy(max(counts, key=counts.get)) if counts else keras.DTypePolicy("float32")

