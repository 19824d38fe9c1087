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
4. checks it numerically: the rebuilt model, given the model's weights,
   must predict bit for bit what the model predicts, on inputs built from
   the model's input specs.

Where a layer's placement could not be kept, or the predictions still
differ, one warning names them and what to do.
"""

import warnings

import keras
import numpy as np

from kmix import _compat
from kmix._tree import is_graph_model, own_weights, resolved_policy, walk
from kmix.placing import place, reload, trace


class Settled:
    """What `settle` did and found.

    Attributes:
        adopted: `{id(layer): (path, planned policy, the reloaded policy)}` for
            the layers that took the reloaded model's policy.
        synced: how many graph nodes and layer constants took the rebuilt values.
        difference: the largest difference between the predictions of the
            model in memory and of the rebuilt one (0.0 when bitwise equal,
            None when not checked), after settling.
        error: why the model cannot be rebuilt from its config, or None.
    """

    def __init__(self, adopted=None, synced=0, difference=None, error=None):
        self.adopted = adopted or {}
        self.synced, self.difference, self.error = synced, difference, error


def settle(model, specs, record=True):
    """Makes `model` compute what `keras.models.load_model` would rebuild from its config.

    Args:
        model: a placed, built model.
        specs: `trace.input_specs(model)`, or None (no numerical check).
        record: give blocks a policy map of the placement first (step 1).

    Returns:
        A `Settled`.
    """
    copy, error = reload.reloaded(model)
    if error is not None:
        return Settled(error=error)
    found = reload.differences(model, copy)
    if found and record and reload.record(model, found, copy):
        copy, error = reload.reloaded(model)
        if error is not None:
            return Settled(error=error)
        found = reload.differences(model, copy)
    adopted = {}
    for key, (layer, path, mine, _, twin) in found.items():
        if twin is None or type(twin) is not type(layer):
            continue
        before = resolved_policy(layer).name
        place.set_policy(layer, resolved_policy(twin).name)
        if reload.describe(layer) == reload.describe(twin):
            adopted[key] = (path, before, resolved_policy(twin).name)
    synced = _sync_graphs(model, copy) + _sync_constants(model, copy)
    if synced or adopted:
        place.reset_compiled_functions(model)
    return Settled(adopted, synced, _difference(model, copy, specs))


def warn_adopted(model, settled, stacklevel):
    """One warning naming the layers with weights whose placement a reload would not keep."""
    lost = [
        (path, before, after) for key, (path, before, after) in settled.adopted.items()
        if before != after and _has_weights(model, key)
    ]
    if not lost:
        return
    described = [f"{path} ({after}, planned {before})" for path, before, after in lost]
    warnings.warn(
        f"kmix.autocast: {len(lost)} layers of model {model.name!r} compute as `keras.models.load_model` "
        f"rebuilds them, not as planned: {described[:6]}{' ...' if len(described) > 6 else ''}. Their "
        "block makes them without passing its dtype on (they take the global policy when the model "
        "is built or loaded), so kmix placed them as a reload will, and the model you train is the "
        "model that reloads. To run them in half as well, build the model and load it under "
        "`keras.config.set_dtype_policy('mixed_...')`, then call `kmix.autocast` on it.",
        stacklevel=stacklevel,
    )


def warn_different(model, settled, stacklevel):
    """One warning where the rebuilt model still predicts otherwise than the model in memory."""
    if not settled.difference:
        return
    warnings.warn(
        f"kmix.autocast placed model {model.name!r}, but the model `keras.models.load_model` rebuilds "
        f"from its config predicts up to {settled.difference:.3g} away from it on the same weights "
        "(an operation of its graph or a layer's own state computes otherwise when rebuilt). Train "
        "the model and reload it with `kmix.autocast` applied again after `load_model`, or save its "
        "weights (`model.save_weights`) and load them into the model built in code.",
        stacklevel=stacklevel,
    )


def _has_weights(model, key):
    for _, layer, _ in walk(model):
        if id(layer) == key:
            return bool(own_weights(layer))
    return False


def _pairs(model, copy):
    """`(layer in memory, rebuilt layer)` for the model and every layer inside it, by walk position."""
    ours, theirs = [model] + [row[1] for row in walk(model)], [copy] + [row[1] for row in walk(copy)]
    if len(ours) != len(theirs):
        return []
    return [(a, b) for a, b in zip(ours, theirs) if type(a) is type(b)]


def _sync_graphs(model, copy):
    """Takes the rebuilt graphs' operations' settings and constant arguments; the number changed."""
    changed = 0
    for ours, theirs in _pairs(model, copy):
        if not (is_graph_model(ours) and is_graph_model(theirs)):
            continue
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


def _sync_constants(model, copy):
    """Takes the rebuilt layers' constant tensors (not variables) where their dtype differs."""
    changed = 0
    for ours, theirs in _pairs(model, copy):
        if is_graph_model(ours):
            continue
        for name, value in vars(theirs).items():
            mine = vars(ours).get(name)
            if place.is_constant(value) and place.is_constant(mine) and _dtype(mine) != _dtype(value):
                setattr(ours, name, value)
                changed += 1
    return changed


def _difference(model, copy, specs):
    """The largest |model(x) - rebuilt(x)| on inputs built from `specs`, the model's weights in both."""
    if specs is None:
        return None
    try:
        copy.set_weights(model.get_weights())
    except Exception:  # noqa: BLE001  a layer saved otherwise (a merged LoRA): not comparable
        return None
    x = trace.sample_inputs(specs)
    try:
        ours = keras.tree.flatten(model(x, training=False))
    except Exception:  # noqa: BLE001  the model cannot run on made-up inputs: nothing to compare
        return None
    try:
        theirs = keras.tree.flatten(copy(x, training=False))
    except Exception:  # noqa: BLE001  the model in memory runs, the rebuilt one does not
        return float("inf")
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


def _is_array(value):
    return keras.ops.is_tensor(value) or isinstance(value, np.ndarray)


def _dtype(value):
    return keras.backend.standardize_dtype(value.dtype)


def _numpy(value):
    return keras.ops.convert_to_numpy(value)
