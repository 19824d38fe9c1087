"""`kmix.autocast(model)`: a copy of a model with each layer placed by precision.

One pipeline, read top to bottom in `autocast`:

1. plan: the rules give every layer of the model a policy (`Rules.plan`, pure);
2. rebuild: the model's config is serialized, every layer's dtype is replaced
   by a `keras.dtype_policies.DTypePolicyMap` holding the plan (keyed by layer
   path, so layers that blocks create with their block's dtype are placed
   too), and the config is deserialized exactly as `keras.models.load_model`
   deserializes a saved model (under the global policy of the moment), so the
   copy in memory is the copy a reload gives. This keeps the model's class (a
   keras-hub `BertBackbone` stays one), its `keras.ops` nodes and slices, its
   nested models and shared layers;
3. copy the weights;
4. verify: a layer whose policy in the copy is not the planned one (a block
   that builds it under the global policy, or with a fixed dtype of its own)
   is reported as not placed, in the table and in one warning.
"""

import collections
import warnings

import keras

from kmix import _compat
from kmix.policy import advice, diagnosed
from kmix.policy.placement import Rules, is_graph_model, own_weights, resolved_policy, safe_replacements, saved_layers, walk
from kmix.policy.policy import Policy

Placement = collections.namedtuple("Placement", "layer cls before after reason")
Placement.__doc__ = """One row of `autocast`'s table: a layer's path and class, its policy
before and after, and the rule that placed it."""


class AutocastTable(list):
    """The rows (`Placement`s) of an `autocast`, printed as an aligned table by `str()`.

    One row per layer, nested layers included (their `layer` is a path such
    as `"transformer_layer_0/self_attention_layer/query"`).
    """

    def __str__(self):
        header = Placement("layer", "class", "before", "after", "why")
        rows = [header] + list(self)
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def moved(self):
        """The paths of the layers whose policy or class changed."""
        return [row.layer for row in self if row.before != row.after or "->" in row.cls]


def autocast(model, policy="O1", float32_layers=None, verbose=False, return_table=False, sample=None):
    """Returns a copy of `model`, with the same weights, with each layer placed by precision.

    Under a policy with half compute (O1, O2, `"mixed_float16"`, ...):

    - half (`policy.to_keras()`): `Dense`, `EinsumDense`, convolutions,
      `Embedding`, attention projections, and every layer not listed below;
    - replaced: `keras.layers.Softmax` by `kmix.layers.Softmax`,
      `keras.layers.MultiHeadAttention` by `kmix.layers.MultiHeadAttention`
      (where they are layers of the model's graph; a `Softmax` that a block
      creates inside itself runs in float32 instead);
    - float32: normalization layers (their variables too, batch-norm
      statistics included, under O2), `Activation("softmax")` /
      `Activation("log_softmax")` (and any layer whose `activation` is one
      of these), the layers producing the model's outputs (looking through
      `keras.ops` nodes and nested models), and `float32_layers` (and, with
      `sample`, the layers the diagnosis of the sample finds overflowing);
    - normalization that a block creates inside itself computes its
      statistics in float32 too: a norm that casts to float32 inside (Keras's
      own, keras-hub's Llama, Gemma and Mistral norms; measured once per
      class) keeps the block's half dtype, with float32 variables, so its
      output still adds to the block's raw tensors; one that squares in half
      (keras-hub's `T5LayerNorm`) computes in float32.

    Under a pure-half policy (O3, `"float16"`) every layer is half except
    `float32_layers`: O3 is the speed baseline. Under float32 compute (O0)
    every layer is float32. `kmix.layers.WithPolicy` layers keep their policy.
    Layers nested in blocks and models are placed by the same rules.

    Args:
        model: a built `keras.Sequential`, a functional `keras.Model`, or a
            subclass of one (keras-hub backbones and tasks). The model's
            custom layers must be serializable (`get_config`), as for
            `model.save`.
        policy: anything `kmix.Policy` accepts; `"O1"` by default.
        float32_layers: layer classes and/or layer names to keep in float32
            as well; a block's or nested model's name covers its inside. A
            path as the table's `layer` column shows it names one layer
            where several share a name (`"t5/decoder_0/self_attention"`).
        verbose: print the table of layer, class, policy before and after.
        return_table: also return the table (an `AutocastTable` of
            `Placement(layer, cls, before, after, reason)` rows).
        sample: a batch `(x, y)` (arrays, tensors, or lists / dicts of them),
            or a `tf.data.Dataset` whose first batch is used; `model` must
            be compiled with its loss. `kmix.diagnose` runs the float32
            model and its half-precision self on it first: the layers that
            overflow (or hold a `-1e9` mask) are kept in float32 (the table's
            `why` says `sample: ...`), and the initial loss scale it advises
            is recorded for the copy's variables, so that `kmix.wrap(opt)`
            (without `initial_scale=`) starts from it when the optimizer is
            built. Ignored under float32 compute.

    Returns:
        The new model, of the same class, uncompiled, or `(model, table)`
        with `return_table=True`. The global policy is left as it was:
        compile inside `kmix.policy_scope(policy)` so that `kmix.wrap` picks
        the loss scaling and master weights the policy needs.

    Raises:
        TypeError: for a subclassed model with its own `call` (use
            `kmix.policy_map` to build it placed instead).
        ValueError: for an unbuilt model, or a name in `float32_layers` that
            is no layer of the model.
        TypeError / ValueError: naming `sample`, for a sample that is not a
            batch `(x, y)` or a dataset, or a model not compiled with a loss.

    Example:

    >>> fast, table = kmix.autocast(model, "O1", float32_layers=["logits"], return_table=True)
    >>> print(table)
    >>> with kmix.policy_scope("O1"):
    ...     fast.compile(optimizer=kmix.wrap("adam"), loss="mse")
    >>> model.compile(optimizer="adam", loss="mse")          # the float32 model, with its loss
    >>> fast = kmix.autocast(model, "O1", sample=(x[:32], y[:32]))  # diagnosed islands and scale
    """
    policy = Policy(policy)
    _check_model(model)
    given = float32_layers
    advised = diagnosed.advise(model, policy, sample) if sample is not None else None
    if advised is not None:
        float32_layers = diagnosed.merge(float32_layers, list(advised.targets))
    rules = Rules(policy, float32_layers)
    plan = rules.plan(model)
    swap = rules.half_compute and not rules.pure
    # A first copy tells the paths its layers get (a block built inside a wrapper's call in the
    # model may be built outside it in a copy); the map is keyed by both.
    probe = _rebuild(model, keras.dtype_policies.DTypePolicyMap(default_policy=rules.default), swap)
    probe_layers = [layer for _, layer, _ in walk(probe)]
    dtype_map = rules.dtype_map(model, plan, probe_layers if len(probe_layers) == len(plan) else None)
    new_model = _rebuild(model, dtype_map, swap)
    table = _verify(model, plan, new_model, rules.plan(new_model))
    _copy_weights(model, new_model)
    unplaced = [row.layer for row in table if "not placed" in row.reason]
    if unplaced:
        warnings.warn(
            f"kmix.autocast could not place {unplaced}: a layer they belong to creates them with a "
            "dtype of its own, or under the global policy rather than its `dtype`, which a saved "
            "model does not carry. They keep the policy a reload gives them, so the copy in "
            "memory predicts as it will after `keras.models.load_model`; see the `why` column of "
            "the table (`return_table=True`). To place them anyway, build the model under "
            "`keras.config.set_dtype_policy(kmix.policy_map(model, policy))` and load it under "
            "the same global policy.",
            stacklevel=2,
        )
    if advised is not None:
        table = advised.finish(new_model, table, given)
    # What kmix.wrap reads when the optimizer is built: compute dtypes, and the advised scale.
    advice.record_model(new_model, advised and advised.initial_scale, policy.name)
    if verbose:
        print(table)
    return (new_model, table) if return_table else new_model


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a keras.Model. Received: model={model!r} (of type {type(model).__name__})."
        )
    if not isinstance(model, keras.Sequential) and not _compat.is_functional(model):
        raise TypeError(
            "kmix.autocast copies Sequential or functional models (keras-hub backbones and tasks "
            f"included); received a {type(model).__name__}, a subclassed model whose `call` a copy "
            "would not know. Instead, build the model with its layers placed: pass "
            "`kmix.policy_map(built_float32_model, policy)` to `keras.config.set_dtype_policy` "
            "(or as the model's `dtype`) before creating it, then copy the weights; keep "
            "softmax in float32 with `kmix.layers.Softmax` / `kmix.layers.MultiHeadAttention`; "
            "and wrap layers that must stay float32 in `kmix.layers.WithPolicy(layer, 'float32')`."
        )
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its layers have no weights to copy. "
            "Start it with `keras.Input(shape)` or call `model.build(input_shape)` first."
        )


def _rebuild(model, dtype_map, swap):
    """Serializes `model`, puts `dtype_map` in place of every layer dtype, deserializes."""
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    map_config = keras.saving.serialize_keras_object(dtype_map)
    replacements = safe_replacements() if swap else {}
    config = _rewrite(config, map_config, {("keras.layers", k.__name__): v for k, v in replacements.items()})
    # The user's own classes, unregistered ones included, by the name their configs give. Keras's
    # own classes are left to Keras: a name such as "Add" is a merge layer and a `keras.ops` node.
    custom = {
        cls.__name__: cls
        for cls in {type(layer) for _, layer, _ in walk(model)} | {type(model)}
        if not cls.__module__.startswith(("keras.", "keras_hub."))
    }
    with keras.saving.custom_object_scope(custom):
        # safe_mode=False: a Lambda's function is the user's own, from this process.
        return keras.saving.deserialize_keras_object(config, safe_mode=False)


def _rewrite(obj, map_config, replacements):
    """A copy of a serialized config with each layer's dtype policy replaced by the map."""
    if isinstance(obj, list):
        return [_rewrite(item, map_config, replacements) for item in obj]
    if not isinstance(obj, dict):
        return obj
    if obj.get("registered_name") == "kmix>WithPolicy":
        return obj  # keeps its own policy, inside too
    out = {key: _rewrite(value, map_config, replacements) for key, value in obj.items()}
    inner = out.get("config")
    if isinstance(inner, dict) and _is_policy_config(inner.get("dtype")):
        inner["dtype"] = map_config
    new_cls = replacements.get((obj.get("module"), obj.get("class_name")))
    if new_cls is not None:
        out.update(module=new_cls.__module__, registered_name=keras.saving.get_registered_name(new_cls))
    return out


def _is_policy_config(value):
    """A serialized `DTypePolicy` (or map); a plain string `dtype` is a tensor dtype (inputs, casts)."""
    return isinstance(value, dict) and "DTypePolicy" in str(value.get("class_name", ""))


def _verify(model, plan, new_model, new_plan):
    """The table: each layer's policy before and in the copy; where the copy missed the plan, why."""
    if len(plan) != len(new_plan):
        raise ValueError(
            f"The copy of model {model.name!r} has {len(new_plan)} layers where the model has "
            f"{len(plan)}: a layer's `get_config` does not re-create it as it is."
        )
    table = AutocastTable()
    saved = saved_layers(model)
    for (path, old, dtype, reason), (_, new, _, _) in zip(plan, new_plan):
        # A nested model computes nothing itself: its layers do, and they have rows of their own.
        if dtype is not None and resolved_policy(new).name != dtype and not is_graph_model(new):
            if id(old) in saved and not new.weights:
                # A layer built in its constructor (`Activation`, `Dropout`) has no path when the
                # map is read; one whose config the model saves keeps a policy set now.
                new.dtype_policy = dtype
            else:
                reason += f" (not placed: {_why_not_placed(new, dtype)})"
        elif dtype is not None:
            # A variable made in `__init__`, before the layer has a path, misses the map.
            wrong = {v.dtype for v in own_weights(new)} - {keras.DTypePolicy(dtype).variable_dtype}
            if wrong:
                reason += f" (not placed: its variables made before its build are {sorted(wrong)})"
        after = resolved_policy(new).name
        if isinstance(old, keras.layers.Lambda):
            new.function = old.function  # the original object, with its closure
        cls = type(old).__name__
        if type(new) is not type(old):
            cls += f" -> kmix.layers.{type(new).__name__}"
        table.append(Placement(path, cls, resolved_policy(old).name, after, reason))
    return table


def _why_not_placed(layer, dtype):
    if isinstance(layer.dtype_policy, keras.dtype_policies.DTypePolicyMap):
        return f"created under {resolved_policy(layer).name} though its policy map says {dtype}"
    return (
        f"created under the global policy or a dtype of its own ({layer.dtype_policy.name}), "
        "not its block's"
    )


def _copy_weights(old, new):
    old_weights, new_weights = old.weights, new.weights
    if len(old_weights) != len(new_weights) or any(
        tuple(a.shape) != tuple(b.shape) for a, b in zip(old_weights, new_weights)
    ):
        raise ValueError(
            f"Cannot copy the weights of model {old.name!r} into its autocast copy: shapes "
            f"{[tuple(w.shape) for w in old_weights]} vs {[tuple(w.shape) for w in new_weights]}."
        )
    for a, b in zip(old_weights, new_weights):
        b.assign(keras.ops.cast(a.value, b.dtype))
