"""`kmix.autocast(model)`: place each layer of a model by an allow/deny list.

Like Apex O1 and `torch.autocast`, matmuls, convolutions, embeddings and
attention projections run in the half compute dtype, while the numerically
sensitive layers stay in float32: normalization, softmax / log-softmax
activations, and the layer that produces each model output. Keras's
`Softmax` and `MultiHeadAttention` are swapped for kmix's, which keep their
softmax in float32 and mask with finite constants.
"""

import collections

import keras

from kmix.policy.policy import Policy

# Float32 islands: statistics over many elements, where half loses precision.
_NORMALIZATION = tuple(
    getattr(keras.layers, name)
    for name in (
        "BatchNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "UnitNormalization",
        "RMSNormalization",
        "SpectralNormalization",
        "Normalization",
    )
    if hasattr(keras.layers, name)
)
_FLOAT32_ACTIVATIONS = ("softmax", "log_softmax")
# Listed for the table: layers whose matmuls are what half precision speeds up.
_HALF_LAYERS = tuple(
    getattr(keras.layers, name)
    for name in (
        "Dense",
        "EinsumDense",
        "Conv1D",
        "Conv2D",
        "Conv3D",
        "Conv1DTranspose",
        "Conv2DTranspose",
        "Conv3DTranspose",
        "DepthwiseConv1D",
        "DepthwiseConv2D",
        "SeparableConv1D",
        "SeparableConv2D",
        "Embedding",
        "MultiHeadAttention",
        "GroupedQueryAttention",
        "Attention",
        "AdditiveAttention",
    )
    if hasattr(keras.layers, name)
)

Placement = collections.namedtuple("Placement", "layer cls before after reason")
Placement.__doc__ = """One row of `autocast`'s table: a layer's name and class, its policy
before and after, and the rule that placed it."""


class AutocastTable(list):
    """The rows (`Placement`s) of an `autocast`, printed as an aligned table by `str()`."""

    def __str__(self):
        header = Placement("layer", "class", "before", "after", "why")
        rows = [header] + list(self)
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
        lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def moved(self):
        """The names of the layers whose policy or class changed."""
        return [row.layer for row in self if row.before != row.after or "->" in row.cls]


def autocast(model, policy="O1", float32_layers=None, verbose=False, return_table=False):
    """Returns a copy of `model`, with the same weights, with each layer placed by precision.

    Under a policy with half compute (O1, O2, `"mixed_float16"`, ...):

    - half (`policy.to_keras()`): `Dense`, `EinsumDense`, convolutions,
      `Embedding`, attention projections, and every layer not listed below;
    - replaced: `keras.layers.Softmax` by `kmix.layers.Softmax`,
      `keras.layers.MultiHeadAttention` by `kmix.layers.MultiHeadAttention`;
    - float32: normalization layers, `Activation("softmax")` /
      `Activation("log_softmax")` (and any layer whose `activation` is one
      of these), the layer producing each model output, and `float32_layers`.

    Under a pure-half policy (O3, `"float16"`) every layer is half except
    `float32_layers`: O3 is the speed baseline. Under float32 compute (O0)
    every layer is float32. `kmix.layers.WithPolicy` layers keep their policy.

    Args:
        model: a `keras.Sequential` (built) or functional `keras.Model`.
        policy: anything `kmix.Policy` accepts; `"O1"` by default.
        float32_layers: layer classes and/or layer names to keep in float32
            as well.
        verbose: print the table of layer, class, policy before and after.
        return_table: also return the table (an `AutocastTable` of
            `Placement(layer, cls, before, after, reason)` rows).

    Returns:
        The new functional model, uncompiled, or `(model, table)` with
        `return_table=True`. The global policy is left as it was: compile
        inside `kmix.policy_scope(policy)` so that `kmix.wrap` picks the loss
        scaling and master weights the policy needs.

    Raises:
        TypeError: for a subclassed model, whose layer graph is not known.
        ValueError: for an unbuilt Sequential model, or a name in
            `float32_layers` that is no layer of the model.

    Example:

    >>> fast, table = kmix.autocast(model, "O1", float32_layers=["logits"], return_table=True)
    >>> print(table)
    >>> with kmix.policy_scope("O1"):
    ...     fast.compile(optimizer=kmix.wrap("adam"), loss="mse")
    """
    policy = Policy(policy)
    graph = _as_functional(model)
    classes, names = _split_float32_layers(float32_layers)
    named = _layers_named(graph, names)
    outputs = _output_layers(graph)
    pure = policy.params_dtype != "float32" and not policy.needs_master_weights
    half_compute = policy.compute_dtype != "float32"
    table = AutocastTable()
    clones = []

    def clone(layer):
        new, row = _place(layer, policy, half_compute, pure, outputs, classes, named)
        clones.append((layer, new))
        table.append(row)
        return new

    new_model = keras.models.clone_model(graph, clone_function=clone, recursive=True)
    for old, new in clones:
        _copy_weights(old, new)
    if verbose:
        print(table)
    return (new_model, table) if return_table else new_model


def _as_functional(model):
    if isinstance(model, keras.Sequential) and type(model) is keras.Sequential:
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            raise ValueError(
                f"Sequential model {model.name!r} is not built, so its layer graph is not known. "
                "Start it with `keras.Input(shape)` or call `model.build(input_shape)` first."
            ) from None
        return keras.Model(inputs[0] if len(inputs) == 1 else inputs, outputs[0], name=model.name)
    if type(model).__name__ == "Functional" and type(model).__module__.startswith("keras."):
        # A fresh functional over the same layers: the copy starts uncompiled.
        return keras.Model(model.input, model.output, name=model.name)
    raise TypeError(
        "kmix.autocast rebuilds the layer graph of a Sequential or functional keras.Model; "
        f"received a {type(model).__name__}, whose graph (and any methods it overrides) a "
        "rebuild would lose. Instead, create the model under `kmix.set_policy(...)` (or in a "
        "`kmix.policy_scope(...)`), use `kmix.layers.Softmax` / `kmix.layers.MultiHeadAttention` "
        "inside it, and wrap layers that must stay in float32 in "
        "`kmix.layers.WithPolicy(layer, 'float32')`."
    )


def _split_float32_layers(float32_layers):
    if float32_layers is None:
        return (), set()
    if isinstance(float32_layers, (str, type)):
        float32_layers = [float32_layers]
    classes, names = [], set()
    for item in float32_layers:
        if isinstance(item, type) and issubclass(item, keras.layers.Layer):
            classes.append(item)
        elif isinstance(item, str):
            names.add(item)
        else:
            raise TypeError(
                "`float32_layers` must hold layer classes or layer names. "
                f"Received: {item!r} (of type {type(item).__name__}) in "
                f"float32_layers={float32_layers!r}."
            )
    return tuple(classes), names


def _layers_named(graph, names):
    """The ids of the layers `names` picks; a nested model's name picks all its layers."""
    layers = list(_all_layers(graph))
    unknown = sorted(names - {layer.name for layer in layers})
    if unknown:
        raise ValueError(
            f"`float32_layers` names {unknown}, which are no layers of model {graph.name!r}. "
            f"Its layers are: {sorted(layer.name for layer in layers)}."
        )
    picked = set()
    for layer in layers:
        if layer.name in names:
            picked.add(id(layer))
            if isinstance(layer, keras.Model):
                picked |= {id(sub) for sub in _all_layers(layer)}
    return picked


def _all_layers(model):
    for layer in model.layers:
        yield layer
        if isinstance(layer, keras.Model):
            yield from _all_layers(layer)


def _output_layers(model):
    """The ids of the layers producing `model`'s outputs, looking inside nested models."""
    if isinstance(model, keras.Sequential):
        last = [model.layers[-1]]
    else:
        last = [model.get_layer(name) for name in model.output_names]
    found = set()
    for layer in last:
        found |= _output_layers(layer) if isinstance(layer, keras.Model) else {id(layer)}
    return found


def _place(layer, policy, half_compute, pure, outputs, classes, named):
    """The clone of `layer` under `policy`, and its table row."""
    from kmix.layers import MultiHeadAttention, Softmax, WithPolicy

    replacements = {keras.layers.Softmax: Softmax, keras.layers.MultiHeadAttention: MultiHeadAttention}
    cls, new_cls = type(layer), type(layer)
    half = policy.to_keras().name
    if isinstance(layer, WithPolicy):
        dtype, reason = None, "WithPolicy: kept"
    elif isinstance(layer, classes) or id(layer) in named:
        dtype, reason = "float32", "float32_layers"
    elif not half_compute:
        dtype, reason = half, "float32 policy"
    elif pure:
        dtype, reason = half, "pure half policy"
    elif id(layer) in outputs:
        dtype, reason = "float32", "model output"
    elif isinstance(layer, _NORMALIZATION):
        dtype, reason = "float32", "normalization"
    elif _activation_name(layer) in _FLOAT32_ACTIVATIONS:
        dtype, reason = "float32", f"{_activation_name(layer)} activation"
    elif cls in replacements:
        new_cls = replacements[cls]
        dtype, reason = half, "kmix safe layer"
    elif isinstance(layer, _HALF_LAYERS):
        dtype, reason = half, "allow list"
    else:
        dtype, reason = half, "follows inputs"
    config = layer.get_config()
    if dtype is not None:
        config["dtype"] = dtype
    if isinstance(layer, keras.layers.Lambda):
        # The function is the user's own, in this process: reloading its bytecode is safe,
        # and the original object (with its closure) is put back in the copy.
        new = new_cls.from_config(config, safe_mode=False)
        new.function = layer.function
    else:
        new = new_cls.from_config(config)
    cls_name = cls.__name__ if new_cls is cls else f"{cls.__name__} -> kmix.layers.{new_cls.__name__}"
    row = Placement(layer.name, cls_name, layer.dtype_policy.name, new.dtype_policy.name, reason)
    return new, row


def _activation_name(layer):
    activation = getattr(layer, "activation", None)
    if activation is None:
        return None
    if isinstance(activation, str):
        return activation
    return getattr(activation, "__name__", None)


def _copy_weights(old, new):
    old_weights, new_weights = old.weights, new.weights
    if len(old_weights) != len(new_weights) or any(
        tuple(a.shape) != tuple(b.shape) for a, b in zip(old_weights, new_weights)
    ):
        raise ValueError(
            f"Cannot copy the weights of layer {old.name!r} ({type(old).__name__}) into its "
            f"autocast copy ({type(new).__name__}): shapes {[tuple(w.shape) for w in old_weights]} "
            f"vs {[tuple(w.shape) for w in new_weights]}."
        )
    for a, b in zip(old_weights, new_weights):
        b.assign(keras.ops.cast(a.value, b.dtype))
