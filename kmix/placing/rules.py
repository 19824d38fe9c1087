"""The plan of `kmix.autocast`: the model's facts gathered in one walk (`gather`), the rules' pure decision on them.

The rules are Apex O1's and `torch.autocast`'s: matmuls, convolutions and embeddings in half; normalization,
softmax, routers, sinusoidal embeddings and the outputs in float32 (an output matmul in half, its output float32).
"""

import collections
import enum
import re

import keras

from kmix import _compat
from kmix._tree import is_graph_model, own_weights, resolved_policy, walk
from kmix.ops import float32_out
from kmix.placing import norms

FLOAT16_MAX = 65504.0
_NORMALIZATION = tuple(getattr(keras.layers, name) for name in (
    "BatchNormalization", "LayerNormalization", "GroupNormalization", "UnitNormalization",
    "RMSNormalization", "SpectralNormalization", "Normalization") if hasattr(keras.layers, name))
_FLOAT32_ACTIVATIONS = ("softmax", "log_softmax")
# Layers whose matmuls half precision speeds up (the table's "allow list").
_HALF_LAYERS = tuple(getattr(keras.layers, name) for name in (
    "Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
    "Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D",
    "Embedding", "MultiHeadAttention", "GroupedQueryAttention", "Attention", "AdditiveAttention")
    if hasattr(keras.layers, name))

Fact = collections.namedtuple("Fact", "path layer parent listed output block norm too_large")
Fact.__doc__ = """One layer as `gather` found it: path, layer, parent; whether the parent's config lists
its config, whether it produces a model output, whether it holds layers; a norm's `norms.Verdict` and
the variable float16 cannot hold, where measured (else None)."""

Row = collections.namedtuple("Row", "path layer parent dtype kind reason")
Row.__doc__ = """A plan's row: path, layer, parent, the policy name planned (None: its own kept), `Kind`, `reason`."""


class Kind(enum.Enum):
    """What a plan's row is, for the stages after the plan (its `reason` is prose, for the table)."""

    NAMED = "in float32_layers"
    KEPT = "inside a WithPolicy: its own policy kept"
    NESTED = "a nested model: its layers are placed"
    UNIFORM = "one policy for every layer (float32 or pure half)"
    IN_BLOCK = "a weightless layer a block makes: as its block makes it"
    OUTPUT = "produces a model output: float32"
    TOO_LARGE = "a variable beyond float16's range: float32"
    HALF_OUT = "produces a model output: its matmul in half, its output float32"
    ISLAND = "a float32 island of the rules (norm, router, sinusoidal embedding): gives way to its block"
    FLOAT32_OP = "softmax / log-softmax: float32"
    SAFE_CLASS = "becomes kmix's class (Softmax, MultiHeadAttention)"
    HALF = "half: a matmul, or follows its inputs"


class Plan(list):
    """`Rules.plan`'s `Row`s, parents first, with its `model` and the ids of the layers whose config it `listed`."""

    def __init__(self, rows, model, listed):
        super().__init__(rows)
        self.model, self.listed = model, listed

    def subtree(self, layer):
        """The layers inside `layer` (not itself)."""
        inside, found = {id(layer)}, []
        for row in self:
            if id(row.parent) in inside:
                inside.add(id(row.layer))
                found.append(row.layer)
        return found


def gather(model, rules, find_outputs=None):
    """A `Fact` per layer of `walk(model)`, parents first, measured as the `rules`' policy needs.

    `find_outputs`, for a subclassed model, takes its layers and gives the ids of those producing its outputs.
    """
    rows = list(walk(model))
    blocks = {id(parent) for _, _, parent in rows}
    outputs = _output_layers(model) if find_outputs is None else set(find_outputs([row[1] for row in rows]))
    probe = rules.half_compute and not rules.pure
    facts = []
    for path, layer, parent in rows:
        in_block = not is_graph_model(parent)
        norm = norms.probe(layer) if probe and in_block and layer.weights and _is_normalization(layer) else None
        listed = not in_block and _compat.lists_layers(parent)
        facts.append(Fact(path, layer, parent, listed, id(layer) in outputs, id(layer) in blocks, norm,
                          _beyond_float16(layer, rules.policy)))
    return facts


class Rules:
    """The placement rules of one `kmix.Policy`; `float32_layers`: classes, names or paths kept in float32."""

    def __init__(self, policy, float32_layers=None):
        self.policy, self.default = policy, policy.to_keras()
        self.classes, self.names = _split_float32_layers(float32_layers)
        self.half_compute = policy.compute_dtype != "float32"
        self.pure = policy.params_dtype != "float32" and not policy.needs_master_weights

    def plan(self, model, facts):
        """The `Plan` for `model` from its `facts` (`gather`), reading nothing else; ValueError for an unknown name."""
        from kmix.layers import WithPolicy

        self._check_names(model, facts)
        kept, named, planned, rows = set(), set(), {}, []
        for fact in facts:
            layer, parent = fact.layer, fact.parent
            if isinstance(layer, WithPolicy) or id(parent) in kept:
                kept.add(id(layer))
            if (layer.name in self.names or fact.path in self.names or isinstance(layer, self.classes)
                    or id(parent) in named):
                named.add(id(layer))  # and everything inside it
            if id(layer) in kept:
                dtype, kind, reason = None, Kind.KEPT, "WithPolicy: kept"
            else:
                dtype, kind, reason = self._place(fact, id(layer) in named)
                if kind is Kind.IN_BLOCK:
                    dtype, reason = _follow_block(layer, parent, planned)
            planned[id(layer)] = dtype
            rows.append(Row(fact.path, layer, parent, dtype, kind, reason))
        return Plan(rows, model, {id(fact.layer) for fact in facts if fact.listed})

    def _place(self, fact, named):
        """`(policy name, Kind, reason)` for one layer."""
        layer, half, in_block = fact.layer, self.default.name, not is_graph_model(fact.parent)
        if named:
            return "float32", Kind.NAMED, "float32_layers"
        if is_graph_model(layer):
            return None, Kind.NESTED, "a nested model: its layers are placed"
        if not self.half_compute:
            return half, Kind.UNIFORM, "float32 policy"
        if fact.too_large:
            return "float32", Kind.TOO_LARGE, f"{fact.too_large} does not fit float16 (largest 65504)"
        if self.pure:
            return half, Kind.UNIFORM, "pure half policy"
        if in_block and not layer.weights:  # a block makes its weightless layers itself, as a reload does
            return None, Kind.IN_BLOCK, None
        if fact.output and self.policy.output_dtype == "float32":
            if fact.block:  # inside, a block adds and multiplies raw tensors, which must share one dtype
                return half, Kind.HALF, "model output, but a block: keeps its dtype"
            if fact.listed and isinstance(layer, _HALF_LAYERS) and float32_out.wrap(
                    getattr(layer, "activation", False)):
                return half, Kind.HALF_OUT, "model output: matmul in half, activation and output float32"
            return "float32", Kind.OUTPUT, "model output"
        if re.search(r"Timestep|Sinusoid", type(layer).__name__):
            return "float32", Kind.ISLAND, "sinusoidal embedding: sin/cos of large arguments, 3 digits in half"
        if in_block and is_router(layer, fact.parent):
            return "float32", Kind.ISLAND, "router of a mixture of experts: its softmax and top-k choose the experts"
        if _is_normalization(layer):
            if not in_block:
                return "float32", Kind.ISLAND, "normalization"
            if fact.norm.float32 is False:  # it squares in half (T5's): float32, its output cast by the block's layers
                return "float32", Kind.ISLAND, f"normalization in a block: {fact.norm.detail}, so float32"
            # float32 statistics inside: half out, the dtype the block adds it to (`x + residual`)
            return (f"mixed_{self.policy.compute_dtype}", Kind.ISLAND,
                    f"normalization in a block: {fact.norm.detail}, half out")
        activation = _activation_name(layer)
        if activation in _FLOAT32_ACTIVATIONS:
            return "float32", Kind.FLOAT32_OP, f"{activation} activation"
        if type(layer) in safe_replacements() and not in_block:
            return half, Kind.SAFE_CLASS, "kmix safe layer"
        if isinstance(layer, keras.layers.Softmax) and not type(layer).__module__.startswith("kmix."):
            return "float32", Kind.FLOAT32_OP, "softmax"
        return half, Kind.HALF, "allow list" if isinstance(layer, _HALF_LAYERS) else "follows inputs"

    def _check_names(self, model, facts):
        unknown = sorted(self.names - {f.layer.name for f in facts} - {f.path for f in facts})
        if unknown:
            raise ValueError(f"`float32_layers` names {unknown}, which are no layers of model {model.name!r}. "
                             f"Its layers are: {sorted({f.layer.name for f in facts})}.")


def safe_replacements():
    """Keras layers that `autocast` makes kmix's: `{keras class: kmix class}`."""
    from kmix.layers import MultiHeadAttention, Softmax

    return {keras.layers.Softmax: Softmax, keras.layers.MultiHeadAttention: MultiHeadAttention}


def is_router(layer, block):
    """Whether `layer` routes a mixture-of-experts `block`, by keras-hub's names (`*gate*` in `*SparseMoe*`)."""
    if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        return False
    block_name, name = type(block).__name__, layer.name.lower()
    if re.search(r"Router$", block_name):
        return True
    moe_block = re.search(r"Sparse|Mo[Ee]Block|Mo[Ee]Layer", block_name) is not None
    return moe_block and re.search(r"gate|router", name) is not None and "expert" not in name


def _follow_block(layer, block, planned):
    """A weightless layer in `block`: the block's planned policy, unless the block gave it a dtype of its own."""
    if resolved_policy(layer).name != resolved_policy(block).name:
        return None, "in a block: a dtype of its own, kept"
    dtype = planned.get(id(block))
    return dtype, "in a block: as its block" if dtype is None else "in a block: follows it"


def _split_float32_layers(float32_layers):
    if float32_layers is None:
        return (), set()
    items = [float32_layers] if isinstance(float32_layers, (str, type)) else float32_layers
    if not isinstance(items, (list, tuple, set, frozenset)):
        raise TypeError("`float32_layers` must be a list of layer classes and/or layer names. "
                        f"Received: float32_layers={items!r} (of type {type(items).__name__}).")
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, keras.layers.Layer))):
            raise TypeError("`float32_layers` must hold layer classes or layer names. "
                            f"Received: {item!r} (of type {type(item).__name__}) in float32_layers={items!r}.")
    return tuple(item for item in items if isinstance(item, type)), {item for item in items if isinstance(item, str)}


def _output_layers(model):
    """The ids of the layers producing `model`'s outputs, through ops nodes and nested models."""
    if isinstance(model, keras.Sequential):
        last = model.layers[-1] if model.layers else None
        if last is None:
            return set()
        return _output_layers(last) if isinstance(last, keras.Model) else {id(last)}
    if not is_graph_model(model):
        return set()
    found, stack = set(), list(keras.tree.flatten(model.outputs))
    while stack:
        operation, node_index = _compat.producer(stack.pop())
        if operation is None or isinstance(operation, keras.layers.InputLayer):
            continue
        if isinstance(operation, keras.Model) and is_graph_model(operation):
            found |= _output_layers(operation)
        elif isinstance(operation, keras.layers.Layer):
            found.add(id(operation))
        else:  # an ops node (`GetItem`, `Mean`, ...): its result dtype follows its inputs
            stack.extend(_compat.node_inputs(operation, node_index))
    return found


def _beyond_float16(layer, policy):
    """`"<variable> (|x| up to <max>)"` for the first own variable of `layer` float16 cannot hold, or None."""
    if "float16" not in (policy.compute_dtype, policy.params_dtype):
        return None  # bfloat16 has float32's range
    for variable in own_weights(layer):
        dtype = keras.backend.standardize_dtype(variable.dtype)
        if not keras.backend.is_float_dtype(dtype) or 0 in tuple(variable.shape):
            continue
        largest = float(keras.ops.max(keras.ops.abs(keras.ops.cast(variable, "float32"))))
        if FLOAT16_MAX < largest < float("inf"):
            return f"{variable.name} (|x| up to {largest:.3g})"
    return None


def _is_normalization(layer):
    """Keras's normalization layers, and other libraries' by name (keras-hub's `LlamaLayerNorm`)."""
    return isinstance(layer, _NORMALIZATION) or "Norm" in type(layer).__name__


def _activation_name(layer):
    activation = getattr(layer, "activation", None)
    return activation if activation is None or isinstance(activation, str) else getattr(activation, "__name__", None)
