"""The one writer of `kmix.autocast`: every change it makes to the user's model is made here.

`place` gives each layer its planned policy on itself (under O2 / O3 its variables recast in place),
`set_layer_policy` is the repair's, `write_maps` gives blocks maps of the placement for a reload,
`settle` takes the twin's `Edits`. autocast undoes all of it on an error (`kmix._preserved.Preserved`).
"""

import collections
import re
import warnings

import keras
import tensorflow as tf

from kmix import _compat
from kmix._tree import is_auto_named, own_weights, pair, resolved_policy, snake_case, walk
from kmix.ops import float32_out
from kmix.placing import trace
from kmix.placing.rules import Kind, safe_replacements

Maps = collections.namedtuple("Maps", "holders entries default")
Maps.__doc__ = """What `write_maps` wrote: the blocks given a map, the `{key: policy}` each map holds (and a holder
its own path, where no key names it), the policy of a layer no key names."""

Edits = collections.namedtuple("Edits", "policies nodes settings constants", defaults=((), (), (), ()))
Edits.__doc__ = """What the model takes from its twin: `policies` [(layer, name)] its blocks give, graph `nodes`
[(node, args, kwargs)] with rebuilt constants, operation `settings` [(op, name, value)], layer `constants`."""


def place(plan):
    """Gives each layer the policy `plan` gives it, kmix's safe class, and its float32-out activation or not."""
    swaps = safe_replacements()
    for row in plan:
        if row.dtype is None:
            continue
        if row.kind is Kind.SAFE_CLASS and type(row.layer) in swaps:
            _compat.set_class(row.layer, swaps[type(row.layer)])  # kmix's class adds no state but these:
            if isinstance(row.layer, keras.layers.Softmax):
                row.layer.output_dtype, row.layer.autocast = None, False  # reads half inputs as they are
        set_output_dtype(row.layer, float32=row.kind is Kind.HALF_OUT)
        set_layer_policy(row.layer, row.dtype)


def set_layer_policy(layer, dtype):
    """Gives one layer the Keras policy `dtype`, with its float variables (but `fixed_dtype_variables`) and tensors."""
    old, new = resolved_policy(layer), keras.DTypePolicy(dtype)
    if old.name == new.name:
        return
    if old.variable_dtype != new.variable_dtype:
        fixed = fixed_dtype_variables(layer, new)
        for variable in own_weights(layer):
            if keras.backend.standardize_dtype(variable.dtype) == old.variable_dtype and id(variable) not in fixed:
                _compat.recast_variable(variable, new.variable_dtype)
    layer.dtype_policy = new
    if old.compute_dtype != new.compute_dtype:
        for name, value in list(vars(layer).items()):
            if is_constant(value) and keras.backend.standardize_dtype(value.dtype) == old.compute_dtype:
                _compat.set_layer_tensor(layer, name, keras.ops.cast(value, new.compute_dtype))


def fixed_dtype_variables(layer, policy):
    """The ids of `layer`'s variables it makes in a dtype of its own (LoRA's), as a rebuild under `policy` shows."""
    weights = own_weights(layer)

    def rebuilt():
        with _compat.stateless(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            copy = type(layer).from_config({**layer.get_config(), "dtype": policy})
            copy.build_from_config(layer.get_build_config())
        return own_weights(copy)

    theirs, _ = trace.attempt(rebuilt)
    if theirs is None or [v.name for v in theirs] != [v.name for v in weights]:  # not rebuilt alone: by name
        return {id(v) for v in weights if v.name.startswith("lora_")}
    return {id(v) for v, t in zip(weights, theirs) if keras.backend.standardize_dtype(t.dtype) != policy.variable_dtype}


def set_output_dtype(layer, float32):
    """Gives `layer` its activation's float32-out form (`kmix.ops.float32_out`), or its plain one back."""
    activation = getattr(layer, "activation", None)
    if float32 and not float32_out.is_wrapped(activation):
        layer.activation = float32_out.wrap(activation)
    elif not float32 and float32_out.is_wrapped(activation):
        layer.activation = float32_out.unwrap(activation)


def write_maps(plan, twin=None, holders=()):
    """Gives a `DTypePolicyMap` of the placement to the blocks re-creating a layer placed otherwise than they are.

    A reload re-creates a block's layers with the block's policy; a map keyed by path (where Keras's and
    keras-hub's layers look theirs up) keeps them as placed. The blocks up to one whose config is saved (or
    the model) get one, `holders` anew; keyed by the paths of a `twin` built before too, but for those whose first
    step Keras counted (a reload counts it anew). Returns the `Maps`.
    """
    placed = [row.layer for row in plan if row.dtype is not None and id(row.layer) not in plan.listed
              and resolved_policy(row.layer).name != resolved_policy(row.parent).name]
    return _give_maps(plan.model, [row[:3] for row in plan], placed, plan.listed, twin, holders)


def stale_maps(plan):
    """The blocks holding a map (an earlier placement's) that gives one of their layers another policy than it has."""
    now = {row.layer.path: resolved_policy(row.layer).name for row in plan if row.layer.path}
    return [row.layer for row in plan if isinstance(row.layer.dtype_policy, keras.dtype_policies.DTypePolicyMap)
            and any(key != row.layer.path and key in now and row.layer.dtype_policy[key].name != now[key]
                    for key in row.layer.dtype_policy)]


def record_maps(model, found, twin=None):
    """Gives maps to the blocks that re-create the layers of `found` (`twin.differences(model, twin)`)."""
    rows = list(walk(model))
    listed = {id(layer) for _, layer, parent in rows if _compat.lists_layers(parent)}
    return _give_maps(model, rows, [row[0] for row in found.values() if row[0] is not model], listed, twin).holders


def _give_maps(model, rows, layers, listed, twin, given=()):
    parents = {id(layer): parent for _, layer, parent in rows}
    holders = {id(block): block for block in given}
    for layer in layers:
        if id(layer) in listed:
            continue  # its own config is saved: no block re-creates it
        block = parents[id(layer)]
        while id(block) not in holders:  # up to the first block whose own config is saved, or the model
            holders[id(block)] = block
            if block is model or id(block) in listed:
                break
            block = parents[id(block)]
    if not holders:
        return Maps([], {}, None)
    named = [(layer, layer) for _, layer, _ in rows]  # (the layer whose path is the key, the layer placed)
    if twin is not None:  # and the twin's paths, but those whose first step Keras counted (anew in each reload)
        theirs = [(other, layer) for _, layer, _, other in pair(model, twin)[1:] if other is not None and other.path]
        tops = {other.path: other for other, _ in theirs}
        named += [(other, layer) for other, layer in theirs if not is_auto_named(tops.get(other.path.split("/")[0]))]
    entries, default = _entries(named), _default(rows)
    for block in holders.values():
        dtype_map = keras.dtype_policies.DTypePolicyMap(default_policy=default)
        for key, policy in entries.items():
            dtype_map[key] = policy
        if block.path and block.path not in dtype_map:
            dtype_map[block.path] = resolved_policy(block)
        if isinstance(block.dtype_policy, keras.dtype_policies.DTypePolicyMap):
            # A map of the user's (a backbone built with one) is replaced on the block alone: its
            # layers keep reading theirs, and the block's config carries the placement.
            _compat.replace_dtype_policy(block, dtype_map)
        else:
            block.dtype_policy = dtype_map
    return Maps(list(holders.values()), entries, default)


def _entries(pairs):
    """`{key: policy}`: each layer's path, a pattern where a step is auto-named (Keras's counter runs on in a
    reload: `t5_layer_norm_4`, `_24`) and every layer the pattern covers has one policy."""
    by_path = {named.path: named for named, _ in pairs if named.path}
    entries, patterns = {}, {}
    for named, layer in pairs:
        key = _path_pattern(named.path, by_path) if named.path else None
        if named.path and key is None:
            entries.setdefault(named.path, resolved_policy(layer))
        elif key is not None:
            patterns.setdefault(key, set()).add(resolved_policy(layer).name)
    for key, names in patterns.items():
        if len(names) == 1:
            entries.setdefault(key, keras.DTypePolicy(names.pop()))
    return entries


def _path_pattern(path, by_path):
    """A regex for `path` with each auto-named step any count of its class, or None when none is."""
    steps, parts, auto = path.split("/"), [], False
    for i, step in enumerate(steps):
        layer = by_path.get("/".join(steps[: i + 1]))
        if i > 0 and is_auto_named(layer):
            parts.append(f"{re.escape(snake_case(type(layer).__name__))}(?:_\\d+)?")
            auto = True
        else:
            parts.append(re.escape(step))
    return "/".join(parts) if auto else None


def _default(rows):
    """The policy most layers compute under: what a layer missing from a map takes."""
    counts = collections.Counter(resolved_policy(layer).name for _, layer, _ in rows)
    return keras.DTypePolicy(counts.most_common(1)[0][0] if counts else "float32")


def settle(model, edits):
    """Makes `model` compute what its twin computes: the twin's `Edits` written, the compiled functions reset."""
    for layer, dtype in edits.policies:
        set_layer_policy(layer, dtype)
    for node, args, kwargs in edits.nodes:
        _compat.set_node_arguments(node, args, kwargs)
    for operation, name, value in edits.settings:
        _compat.set_operation_setting(operation, name, value)
    for layer, name, value in edits.constants:
        _compat.set_layer_tensor(layer, name, value)
    reset_compiled_functions(model)


def reset_compiled_functions(model):
    """Drops the train / test / predict functions Keras compiled for the old placement."""
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)


def recast_blocker(model, plan):
    """Why `plan` cannot recast `model`'s variables in place (an optimizer's slots, replicas), or None."""
    if not any(row.dtype is not None and own_weights(row.layer) and keras.DTypePolicy(row.dtype).variable_dtype
               != resolved_policy(row.layer).variable_dtype for row in plan):
        return None
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False) and optimizer.variables:
        return f"its optimizer {type(optimizer).__name__} is built and holds state for the float32 variables"
    if _compat.model_distribute_strategy(model) is not None:
        return "its variables were made under a tf.distribute strategy (one copy per replica)"
    return None


def is_constant(value):
    """A float tensor (not a variable): what a layer may hold as an attribute, computed when built."""
    return (isinstance(value, (tf.Tensor, tf.SparseTensor, tf.RaggedTensor))  # tf.is_tensor's, not its 10 us a call
            and keras.backend.is_float_dtype(keras.backend.standardize_dtype(value.dtype)))
