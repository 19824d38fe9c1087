"""What trains is what reloads: the placed model made to compute what `load_model` rebuilds.

`keras.models.load_model` rebuilds a model from its config: a Sequential or
functional model from the configs of its layers, a keras-hub backbone or a
block by running its constructor again, under the placed policies. What the
constructor computed once from the dtypes it saw is made anew there: a
`keras.ops` node's constant (Gemma scales its embeddings by
`ops.cast(sqrt(hidden_dim), x.dtype)`), a `Cast` to `x.dtype`, a rotary table
a layer holds, the policy of a layer whose block gives it none. `settle`
builds that model (`reload.reloaded`: the config, no weights), then

1. gives each block that re-creates a layer otherwise a policy map of the
   placement (`reload.record`), so that the rebuilt layer is placed alike;
2. makes each layer still placed otherwise in memory take the rebuilt one's
   policy (its block or class decides, not kmix: a layer made without
   `dtype=` takes the global policy when it is loaded);
3. takes the rebuilt graph's operations' settings and constants, and the
   rebuilt layers' constant tensors, into the model in memory;
4. checks it numerically (`compare`): the rebuilt model, run on the model's
   own variables, must predict bit for bit what the model predicts, on
   inputs built from the model's input specs.

The rebuilt model is a twin built without weights (`reload.reloaded`): it
costs the model's layers, not its weights.

Where a layer's placement could not be kept, or the predictions still
differ, one warning names them and what to do.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

from kmix import _compat
from kmix._tree import is_graph_model, own_weights, pair, resolved_policy
from kmix.placing import place, reload, repair, trace


class Settled:
    """What `settle` did and found.

    Attributes:
        adopted: `{id(layer): (path, planned policy, the reloaded policy, has own weights)}` for
            the layers that took the reloaded model's policy: their block
            gives them a dtype of its own.
        synced: how many graph nodes and layer constants took the rebuilt values.
        difference: the largest difference between the predictions of the
            model in memory and of the rebuilt one (0.0 when bitwise equal,
            None when not checked), set by `compare`.
        twin: the rebuilt model (no weights of its own) `compare` runs, or None.
        unchecked: the error (out of memory) that stopped `compare`, or None.
        error: why the model cannot be rebuilt from its config, or None.
        load_under: the Keras global policy the model must be loaded under to
            be rebuilt as placed (layers made without `dtype=` take it), or
            None when the global policy of the moment does.
        holders: the blocks given a policy map of the placement.
        unplaced: `{id(layer): (path, in memory, after a reload)}` for the
            layers a reload places otherwise under any one global policy.
            They are kept as placed: what Keras gives them depends on the
            global policy of the process that loads the model.
    """

    def __init__(self, adopted=None, synced=0, difference=None, error=None, load_under=None, unplaced=None,
                 holders=(), twin=None):
        self.adopted, self.unplaced, self.holders = adopted or {}, unplaced or {}, list(holders)
        self.synced, self.difference, self.error, self.load_under = synced, difference, error, load_under
        self.twin, self.unchecked = twin, None


def settle(model, specs, half_policy, holders=()):
    """Makes `model` compute what `keras.models.load_model` would rebuild from its config.

    Args:
        model: a placed, built model.
        specs: `trace.input_specs(model)`, or None (no numerical check).
        half_policy: the Keras policy most layers were placed under. A layer
            its block makes without `dtype=` takes Keras's global policy when
            the model is loaded: rebuilt under the global policy of the
            moment and under `half_policy`, such a layer differs in one; one
            its block gives a dtype of its own differs in both, alike.

    Returns:
        A `Settled`; `compare` checks it on numbers.
    """
    reload.write_maps(model, list(holders))
    copy, error = reload.reloaded(model)
    if error is not None:
        return Settled(error=error, holders=holders)
    found = reload.differences(model, copy)
    recorded = reload.record(model, found, copy) if found else []
    holders = list({id(block): block for block in list(holders) + recorded}.values())
    if recorded:
        copy, error = reload.reloaded(model)
        if error is not None:
            return Settled(error=error, holders=holders)
        found = reload.differences(model, copy)
    by_global, load_under, plain = {}, None, copy
    if found and half_policy != keras.config.dtype_policy().name:
        other, error = reload.reloaded(model, half_policy)
        if error is None:
            found_other = reload.differences(model, other)
            by_block = {k: row for k, row in found.items() if k in found_other and row[3] == found_other[k][3]}
            by_global = {k: row for k, row in found.items() if k not in by_block}
            if by_global and not set(found_other) - set(by_block):
                copy, load_under = other, half_policy  # loaded under it, the model is rebuilt as placed
            found = by_block
        else:  # Keras cannot build it under the half policy: which layers the global decides is unknown
            by_global, found = found, {}
    adopted = {}
    for key, (layer, path, _, _, twin) in found.items():
        if twin is None or type(twin) is not type(layer):
            continue
        before = resolved_policy(layer).name
        place.set_policy(layer, resolved_policy(twin).name)
        if reload.describe(layer) == reload.describe(twin):
            adopted[key] = (path, before, resolved_policy(twin).name, bool(own_weights(layer)))
    pairs = [(a, b) for _, a, _, b in pair(model, copy) if type(a) is type(b)]
    synced = _sync_graphs(pairs) + _sync_constants(pairs)
    if synced or adopted:
        place.reset_compiled_functions(model)
    if by_global and not any(own_weights(row[0]) for row in by_global.values()) and _difference(model, plain, specs) == 0:
        by_global, load_under, copy = {}, None, plain  # only weightless layers differ, and nothing they compute
    unplaced = {} if load_under else {k: (row[1], row[2], row[3]) for k, row in by_global.items()}
    return Settled(adopted, synced, load_under=load_under, unplaced=unplaced, holders=holders,
                   twin=None if unplaced else copy)


def compare(model, settled, specs, outputs=None):
    """Sets `settled.difference`: the model's outputs against its twin's, on the model's variables.

    Args:
        outputs: the model's outputs on `trace.sample_inputs(specs)` where a
            call of the placement as it is computed them; else computed here.
    """
    try:
        if settled.twin is not None:
            settled.difference = _difference(model, settled.twin, specs, outputs)
    except _OUT_OF_MEMORY as e:
        settled.unchecked = e
    settled.twin = None  # the twin goes with the check
    return settled


def warn(model, settled, stacklevel):
    """One warning for what a reload would not rebuild as placed: which layers, and what to do."""
    if settled.unchecked is not None:
        message = (
            f"it could not check that the model `keras.models.load_model` rebuilds predicts what it predicts "
            f"({repair.first_words(settled.unchecked)}, on a batch of 2 made-up inputs). The placement stands; "
            "check a reload yourself on a small batch: `keras.models.load_model(path)(x)` against `model(x)`."
        )
    elif settled.error is not None:
        message = (
            f"Keras cannot build it from its config ({repair.first_words(settled.error)}), so `model.save` will "
            "not load back as it is. Save its weights (`model.save_weights`) and build the model in code, "
            "then autocast it again."
        )
    elif settled.load_under is not None:
        message = (
            "some of its layers are made without `dtype=` (they take Keras's global policy when the model "
            f"is built or loaded), so `keras.models.load_model` rebuilds it as placed only under the global "
            f"policy {settled.load_under!r}: load it with `with kmix.policy_scope({settled.load_under!r}): "
            "model = keras.models.load_model(path)`."
        )
    elif settled.unplaced:
        described = [f"{path} ({describe_policy(mine)} in memory, {describe_policy(got)} after a reload)"
                     for path, mine, got in settled.unplaced.values()]
        message = (
            f"`keras.models.load_model` would place {len(described)} layers otherwise: {described[:6]}"
            f"{' ...' if len(described) > 6 else ''}. Their blocks make them without passing their dtype on "
            "(they take Keras's global policy when loaded), so a reloaded model computes there as Keras "
            "builds it: after `load_model`, call `kmix.autocast` on it again."
        )
    elif _lost(settled):
        described = [f"{path} ({after}, planned {before})" for path, before, after in _lost(settled)]
        message = (
            f"its blocks make {len(described)} layers with a dtype of their own, which a reload gives them "
            f"again: {described[:6]}{' ...' if len(described) > 6 else ''}. They compute so in memory too, "
            "so that the model you train is the model that reloads; to keep them in float32, change the "
            "block's code, or wrap the block in `kmix.layers.WithPolicy`."
        )
    elif settled.difference:
        message = (
            f"the model `keras.models.load_model` rebuilds from its config predicts up to "
            f"{settled.difference:.3g} away from it on the same weights (an operation of its graph or a "
            "layer's own state computes otherwise when rebuilt). After `load_model`, call `kmix.autocast` "
            "on it again, or load the saved weights (`model.save_weights`) into the model built in code."
        )
    else:
        return
    warnings.warn(f"kmix.autocast placed model {model.name!r}, but {message}", stacklevel=stacklevel)


def describe_policy(description):
    """`reload.describe`'s tuple as the table shows it: "LayerNormalization mixed_float16"."""
    if isinstance(description, str):
        return description
    cls, compute, variable, _ = description
    return f"{cls} {compute if compute == variable else f'mixed_{compute}'}"


def _lost(settled):
    """The adopted layers with weights of their own that lost float32 (compute or variables): `[(path, before, after)]`.

    A block that makes a layer float32 itself (MMDiT's query norms) only adds
    precision: that is not worth a word.
    """
    lost = []
    for path, before, after, weighted in settled.adopted.values():
        planned, got = keras.DTypePolicy(before), keras.DTypePolicy(after)
        less = (planned.compute_dtype == "float32" and got.compute_dtype != "float32") or (
            planned.variable_dtype == "float32" and got.variable_dtype != "float32")
        if less and weighted:
            lost.append((path, before, after))
    return lost


def _sync_graphs(pairs):
    """Takes the rebuilt graphs' operations' settings and constant arguments; the number changed.

    Args:
        pairs: `[(layer in memory, its rebuilt twin)]`.
    """
    changed = 0
    for ours, theirs in pairs:
        if not (_compat.is_functional(ours) and _compat.is_functional(theirs)):
            continue  # a Sequential's layers are its whole graph
        nodes, twins = _compat.graph_nodes(ours), _compat.graph_nodes(theirs)
        if len(nodes) != len(twins):
            continue
        for node, twin in zip(nodes, twins):
            operation, args, kwargs = _compat.node_call(node)
            other, other_args, other_kwargs = _compat.node_call(twin)
            if isinstance(operation, keras.layers.Layer) or type(operation) is not type(other):
                continue  # a layer keeps its own state (`_sync_constants`)
            changed += _sync_settings(operation, other)
            try:
                new = keras.tree.map_structure(_rebuilt_constant, (args, kwargs), (other_args, other_kwargs))
            except (TypeError, ValueError):
                continue  # not the same call structure: left as it is
            if any(a is not b for a, b in zip(keras.tree.flatten((args, kwargs)), keras.tree.flatten(new))):
                _compat.set_node_arguments(node, *new)
                changed += 1
    return changed


def _rebuilt_constant(ours, theirs):
    """The argument the graph in memory should call with: a constant as it was rebuilt."""
    if isinstance(ours, keras.KerasTensor) or not _is_array(ours) or not _is_array(theirs):
        return ours
    if _dtype(ours) == _dtype(theirs) and np.array_equal(_numpy(ours), _numpy(theirs)):
        return ours
    return theirs


def _sync_settings(operation, other):
    """Copies the plain settings (a `Cast`'s dtype, ...) in which a rebuilt operation differs."""
    changed = 0
    for name, value in vars(other).items():
        if name == "name" or name.startswith("_") or name not in vars(operation):
            continue
        if isinstance(value, (str, int, float, bool, type(None))) and vars(operation)[name] != value:
            setattr(operation, name, value)
            changed += 1
    return changed


def _sync_constants(pairs):
    """Takes the rebuilt layers' constant tensors (not variables) where their dtype differs."""
    changed = 0
    for ours, theirs in pairs:
        if is_graph_model(ours):
            continue
        for name, value in vars(theirs).items():
            mine = vars(ours).get(name)
            if place.is_constant(value) and place.is_constant(mine) and _dtype(mine) != _dtype(value):
                setattr(ours, name, value)
                changed += 1
    return changed


def _difference(model, copy, specs, ours=None):
    """The largest |model(x) - rebuilt(x)| on inputs built from `specs`, both on the model's variables."""
    if specs is None:
        return None
    x = trace.sample_inputs(specs)
    try:
        if ours is None:
            with trace.untouched(model):
                ours = model(x, training=False)
    except _OUT_OF_MEMORY:
        raise
    except Exception:  # noqa: BLE001  the model cannot run on made-up inputs: nothing to compare
        return None
    ours = keras.tree.flatten(ours)
    try:
        theirs = reload.run(copy, model, x)
    except _OUT_OF_MEMORY:
        raise
    except Exception:  # noqa: BLE001  the model in memory runs, the rebuilt one does not
        return float("inf")
    if theirs is None:
        return None
    theirs = keras.tree.flatten(theirs)
    worst = 0.0
    for a, b in zip(ours, theirs):
        a, b = keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        if a.dtype != b.dtype or a.shape != b.shape:
            return float("inf")
        a, b = a.astype("float64"), b.astype("float64")
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        if not same.all():
            gap = np.abs(a - b)[~same]
            worst = max(worst, float(np.max(np.where(np.isfinite(gap), gap, np.inf))))
    return worst


_OUT_OF_MEMORY = (MemoryError, tf.errors.ResourceExhaustedError)


def _is_array(value):
    return keras.ops.is_tensor(value) or isinstance(value, np.ndarray)


def _dtype(value):
    return keras.backend.standardize_dtype(value.dtype)


def _numpy(value):
    return keras.ops.convert_to_numpy(value)
