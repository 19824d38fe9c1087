"""Where each layer of a model runs: the opt levels' allow/deny lists, and `policy_map`.

The rules are those of Apex O1 and `torch.autocast`: matmuls, convolutions,
embeddings and attention projections run in the half compute dtype;
normalization layers, softmax / log-softmax and the layers producing the
model's outputs stay in float32. They are applied to every layer of a model,
layers nested in other layers and models included, by `kmix.autocast` and by
`kmix.policy_map` (the route for subclassed models).
"""

import re

import keras

from kmix import _compat
from kmix.policy import norms
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


def safe_replacements():
    """Keras layers that `autocast` swaps for kmix's: `{keras class: kmix class}`."""
    from kmix.layers import MultiHeadAttention, Softmax

    return {keras.layers.Softmax: Softmax, keras.layers.MultiHeadAttention: MultiHeadAttention}


def walk(root):
    """`(path, layer, parent)` for every layer inside `root`, depth first, each layer once.

    `path` joins the names from `root` down (`"encoder/attention/query"`).
    Layers that a custom layer or a keras-hub block creates in `build` are
    found too. Input layers are left out.
    """
    seen = {id(root)}

    def visit(layer, prefix):
        for child in _children(layer):
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}{child.name}"
            if not isinstance(child, keras.layers.InputLayer):
                yield path, child, layer
            yield from visit(child, path + "/")

    yield from visit(root, "")


def saved_layers(root):
    """The ids of the layers whose own configs `root`'s config holds, dtype policies included.

    These are the layers of Sequential and functional graphs that list their
    layers in `get_config()`. A keras-hub backbone's config holds only its
    constructor arguments: it re-creates its layers, as blocks do.
    """
    lists = {}

    def listed(parent):
        if id(parent) not in lists:
            lists[id(parent)] = is_graph_model(parent) and "layers" in _config(parent)
        return lists[id(parent)]

    return {id(layer) for _, layer, parent in walk(root) if listed(parent)}


def own_weights(layer):
    """The variables `layer` holds itself, not through the layers inside it."""
    inherited = {id(w) for child in _children(layer) for w in child.weights}
    return [w for w in layer.weights if id(w) not in inherited]


def _config(model):
    """`model`'s config as `model.save` writes it (a layer's auto config included)."""
    return keras.saving.serialize_keras_object(model).get("config") or {}


def _children(layer):
    """The layers directly inside `layer`: a graph model's layers, else those it tracks."""
    if is_graph_model(layer):
        return list(layer.layers)  # not the hidden functional model a Sequential keeps
    return _compat.sublayers(layer)


def resolved_policy(layer):
    """The `keras.DTypePolicy` `layer` computes under (a `DTypePolicyMap` looked up by path)."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


class Rules:
    """The placement rules of one policy, for the layers of one model.

    Args:
        policy: a `kmix.Policy`.
        float32_layers: layer classes and/or layer names (a nested model's
            or block's name covers everything inside it) kept in float32; a
            name may also be a path as `walk` gives it (`"t5/decoder_0/attention"`),
            which names one layer where several share a name.
    """

    def __init__(self, policy, float32_layers=None):
        self.policy = policy
        self.default = policy.to_keras()
        self.classes, self.names = _split_float32_layers(float32_layers)
        self.half_compute = policy.compute_dtype != "float32"
        self.pure = policy.params_dtype != "float32" and not policy.needs_master_weights

    def plan(self, model):
        """`[(path, layer, keras_policy_name_or_None, reason)]` for every layer of `model`.

        `None` means "keep the layer's own policy" (inside a `WithPolicy`, or a
        weightless layer a block created).
        """
        from kmix.layers import WithPolicy

        rows = list(walk(model))
        self._check_names(model, rows)
        kept = _subtree_ids([layer for _, layer, _ in rows if isinstance(layer, WithPolicy)])
        named = _subtree_ids([layer for path, layer, _ in rows if layer.name in self.names or path in self.names])
        outputs = _output_layers(model)
        plan = []
        for path, layer, parent in rows:
            if id(layer) in kept:
                dtype, reason = None, "WithPolicy: kept"
            else:
                in_block = not is_graph_model(parent)
                dtype, reason = self._place(layer, id(layer) in named, id(layer) in outputs, in_block)
            plan.append((path, layer, dtype, reason))
        return plan

    def dtype_map(self, model, plan, copy_layers=None):
        """The `DTypePolicyMap` of `plan` (from `self.plan(model)`): an entry per layer placed off the default.

        Layers without variables have entries too: a float32 layer's constants
        (a `Normalization`'s mean) are cast to its compute dtype when it is built.

        A layer's path depends on how the model was built, not only on the
        layer (a Sequential built from `keras.Input` or from its config; a
        block built inside a wrapper's call or before it): each entry is keyed
        by its path without the model's name and with it, and `copy_layers`,
        the layers of a copy of `model` in `plan`'s order, adds the paths they
        have there. Keys are exact paths, never broad patterns: a pattern could
        place a layer of the same name elsewhere. The one pattern: a layer a
        block creates without a name is named by Keras's counter
        (`t5_layer_norm_4`), which runs on in every copy and reload
        (`t5_layer_norm_24`), so it is keyed by its block's path and its class's
        name with any counter (`_auto_name_keys`).
        """
        prefix = f"{model.name}/"
        entries = {}
        copy_layers = copy_layers or [None] * len(plan)
        for (_, layer, dtype, _), copy in zip(plan, copy_layers):
            if dtype is None or dtype == self.default.name:
                continue
            for path in (layer.path, getattr(copy, "path", None)):
                if path:
                    entries.setdefault(path[len(prefix):] if path.startswith(prefix) else path, dtype)
        dtype_map = keras.dtype_policies.DTypePolicyMap(default_policy=self.default)
        for relative, dtype in entries.items():
            for key in (relative, prefix + relative):
                if key not in dtype_map:
                    dtype_map[key] = keras.DTypePolicy(dtype)
        for key, dtype in _auto_name_keys(plan, prefix, self.default.name):
            dtype_map[key] = keras.DTypePolicy(dtype)
        return dtype_map

    def _place(self, layer, named, output, in_block):
        """The Keras policy name and the reason; `in_block`: created inside a layer, not a graph."""
        half = self.default.name
        if named or isinstance(layer, self.classes):
            return "float32", "float32_layers"
        if not self.half_compute:
            return half, "float32 policy"
        if self.pure:
            return half, "pure half policy"
        if in_block and not layer.weights:
            # A block creates its weightless sublayers itself when it is built or loaded (keras-hub's
            # Llama attention makes its softmax float32): a placement of ours would not survive
            # `model.save`, so they stay as the block made them.
            return None, "in a block: as the block made it"
        if output and self.policy.output_dtype == "float32":
            if any(True for _ in walk(layer)):
                # Inside, a block adds and multiplies raw tensors, which must share one dtype.
                return half, "model output, but a block: keeps its dtype"
            return "float32", "model output"
        if _is_normalization(layer):
            return _place_normalization(layer, self.policy.compute_dtype) if in_block else ("float32", "normalization")
        activation = _activation_name(layer)
        if activation in _FLOAT32_ACTIVATIONS:
            return "float32", f"{activation} activation"
        if type(layer) in safe_replacements() and not in_block:
            return half, "kmix safe layer"
        if isinstance(layer, keras.layers.Softmax) and not _is_kmix(layer):
            return "float32", "softmax"
        if isinstance(layer, _HALF_LAYERS):
            return half, "allow list"
        return half, "follows inputs"

    def _check_names(self, model, rows):
        unknown = sorted(self.names - {layer.name for _, layer, _ in rows} - {path for path, _, _ in rows})
        if unknown:
            raise ValueError(
                f"`float32_layers` names {unknown}, which are no layers of model {model.name!r}. "
                f"Its layers are: {sorted({layer.name for _, layer, _ in rows})}."
            )


def policy_map(model, policy="O1", float32_layers=None):
    """A `keras.dtype_policies.DTypePolicyMap` that gives `model`'s layers `policy`'s placement.

    The route for models `kmix.autocast` cannot rebuild (a subclassed model
    with its own `call`), and for keras-hub backbones, which accept a policy
    map as their `dtype`. The map is keyed by layer path: build a fresh
    instance of the model with the map as the global dtype policy (or as its
    `dtype`), and its layers take the placement as they create their
    variables (layers without variables, as they are built).

    Args:
        model: a built model (any kind), named as the model you will build
            and with its layers named alike: the map is keyed by layer path,
            which starts with a subclassed model's name.
        policy: anything `kmix.Policy` accepts; `"O1"` by default.
        float32_layers: layer classes and/or layer names to keep in float32.

    Returns:
        A `DTypePolicyMap` whose default is `policy.to_keras()`, with an
        entry for each layer with variables that the rules place elsewhere.

    Example:

    >>> template = MyModel(name="net"); template(x)                # float32
    >>> keras.config.set_dtype_policy(kmix.policy_map(template, "O2"))
    >>> model = MyModel(name="net"); model(x)                      # float32 norms, half dense
    >>> keras.config.set_dtype_policy("float32")
    >>> model.set_weights(template.get_weights())
    """
    rules = Rules(Policy(policy), float32_layers)
    return rules.dtype_map(model, rules.plan(model))


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


def _subtree_ids(layers):
    ids = set()
    for layer in layers:
        ids.add(id(layer))
        ids |= {id(sub) for _, sub, _ in walk(layer)}
    return ids


def _output_layers(model):
    """The ids of the layers producing `model`'s outputs, through ops nodes and nested models."""
    if isinstance(model, keras.Sequential):
        last = model.layers[-1] if model.layers else None
        if last is None:
            return set()
        return _output_layers(last) if isinstance(last, keras.Model) else {id(last)}
    if not is_graph_model(model):
        return set()
    found = set()
    stack = list(keras.tree.flatten(model.outputs))
    while stack:
        operation, node_index = _compat.producer(stack.pop())
        if isinstance(operation, keras.layers.InputLayer) or operation is None:
            continue
        if isinstance(operation, keras.Model) and is_graph_model(operation):
            found |= _output_layers(operation)
        elif isinstance(operation, keras.layers.Layer):
            found.add(id(operation))
        else:  # an ops node (`GetItem`, `Mean`, ...): its result dtype follows its inputs
            stack.extend(_compat.node_inputs(operation, node_index))
    return found


def is_graph_model(model):
    """A Sequential or functional model (a keras-hub backbone included): its graph is known."""
    return isinstance(model, keras.Sequential) or _compat.is_functional(model)


def _is_normalization(layer):
    """Keras's normalization layers, and other libraries' by name (keras-hub's `LlamaLayerNorm`)."""
    return isinstance(layer, _NORMALIZATION) or "Norm" in type(layer).__name__


def _auto_name_keys(plan, prefix, default):
    """`(pattern, policy name)` for the layers of `plan` that Keras named by its counter.

    A block's sublayer made without `name=` is called `<class in snake case>` or
    `<...>_<n>`, n counting every layer of that class made in the process, so a
    copy's names differ from the model's. The pattern keeps the block's path
    exact and lets the counter vary: `encoder_layer_0/t5_layer_norm(?:_\\d+)?`.
    It is given only where every layer it covers in `model` has one placement
    (then no two keys can match one path), and only off the default.
    """
    found = {}  # pattern -> policy names of the layers it covers
    for _, layer, dtype, _ in plan:
        path = layer.path or ""
        parent = path.rpartition("/")[0]
        if dtype is None or not parent or not is_auto_named(layer):
            continue
        base = _snake_case(type(layer).__name__)
        if parent.startswith(prefix):
            parent = parent[len(prefix):]
        found.setdefault(f"{re.escape(parent)}/{re.escape(base)}(?:_\\d+)?", set()).add(dtype)
    keys = []
    for pattern, dtypes in found.items():
        if len(dtypes) == 1 and dtypes != {default}:
            keys += [(pattern, *dtypes), (re.escape(prefix) + pattern, *dtypes)]
    return keys


def is_auto_named(layer):
    """Whether Keras named `layer` by its counter (made without `name=`): `t5_layer_norm_4`."""
    if layer is None:
        return False
    return re.fullmatch(re.escape(_snake_case(type(layer).__name__)) + r"(_\d+)?", layer.name) is not None


def _snake_case(class_name):
    """The name Keras gives an unnamed layer of `class_name` before its counter (`T5LayerNorm` -> `t5_layer_norm`)."""
    name = re.sub(r"\W+", "", class_name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _place_normalization(layer, half):
    """A norm a block created: float32 statistics whatever it is, the block's dtype out where it can.

    The block adds the norm's output to raw tensors of its own dtype (`x + residual`). A norm
    that computes its statistics in float32 inside (`norms.probe`: Keras's, Llama's, Gemma's)
    keeps the half compute dtype with float32 variables, and so hands back the block's dtype.
    One that squares in half (T5's) computes in float32: its output goes to the block's layers
    (attention, dense), which cast their inputs; T5 takes the residual before the norm.
    """
    verdict = norms.probe(layer)
    if verdict.float32 is False:
        return "float32", f"normalization in a block: {verdict.detail}, so float32"
    return f"mixed_{half}", f"normalization in a block: {verdict.detail}, half out"


def _is_kmix(layer):
    return type(layer).__module__.startswith("kmix.")


def _activation_name(layer):
    activation = getattr(layer, "activation", None)
    if activation is None:
        return None
    if isinstance(activation, str):
        return activation
    return getattr(activation, "__name__", None)
