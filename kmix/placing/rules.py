"""Where each layer of a model runs: the opt levels' allow/deny lists (the plan of `kmix.autocast`).

The rules are those of Apex O1 and `torch.autocast`: matmuls, convolutions,
embeddings and attention projections run in the half compute dtype;
normalization layers, softmax / log-softmax and the model's outputs stay in
float32 (a `Dense` or convolution producing an output computes its matmul in
half and hands float32 out through its activation's `kmix.ops.float32_out`
form, as TensorFlow's guide and torch autocast do). They are applied to every layer of a model,
layers nested in other layers and models included. `Rules.plan` is pure: it
reads the model and changes nothing (`place` places the plan).
"""

import collections
import enum
import re

import keras

from kmix import _compat
from kmix._tree import is_graph_model, own_weights, resolved_policy, walk
from kmix.ops import float32_out
from kmix.placing import norms

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


def _config(model):
    """`model`'s config as `model.save` writes it (a layer's auto config included)."""
    return keras.saving.serialize_keras_object(model).get("config") or {}


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

    def plan(self, model, outputs=None):
        """A `Plan`: a `Row(path, layer, dtype, kind, reason)` for every layer of `model`.

        `None` means "keep the layer's own policy" (inside a `WithPolicy`, or a
        weightless layer a block made with a dtype other than its own).

        Args:
            model: a built model.
            outputs: the ids of the layers producing the model's outputs, for a
                model whose graph is not known (a subclassed model: see
                `kmix.placing.trace`); read from the graph otherwise.
        """
        from kmix.layers import WithPolicy

        rows = list(walk(model))
        self._check_names(model, rows)
        kept = _subtree_ids([layer for _, layer, _ in rows if isinstance(layer, WithPolicy)])
        named = _subtree_ids([layer for path, layer, _ in rows if layer.name in self.names or path in self.names])
        outputs = _output_layers(model) if outputs is None else set(outputs)
        # An output layer hands float32 out through its activation, which a reload keeps only where
        # the model's config lists the layer's own config (a constructor re-creates the others).
        listed = saved_layers(model) if outputs and self.half_compute and not self.pure else set()
        planned = {}  # id(layer) -> the policy name planned for it (a block's, for its sublayers)
        plan = Plan()
        for path, layer, parent in rows:
            if id(layer) in kept:
                dtype, kind, reason = None, Kind.KEPT, "WithPolicy: kept"
            else:
                in_block = not is_graph_model(parent)
                output = id(layer) in outputs and ("listed" if id(layer) in listed else "made")
                dtype, kind, reason = self._place(layer, id(layer) in named, output, in_block, parent)
                if kind is Kind.IN_BLOCK:
                    dtype, reason = _follow_block(layer, parent, planned)
            planned[id(layer)] = dtype
            plan.append(Row(path, layer, dtype, kind, reason))
        return plan

    def _place(self, layer, named, output, in_block, parent):
        """`(policy name, Kind, reason)`; `in_block`: created inside `parent`, a layer, not a graph."""
        half = self.default.name
        if named or isinstance(layer, self.classes):
            return "float32", Kind.NAMED, "float32_layers"
        if is_graph_model(layer):
            return None, Kind.NESTED, "a nested model: its layers are placed"
        if not self.half_compute:
            return half, Kind.UNIFORM, "float32 policy"
        too_large = _beyond_float16(layer, self.policy)
        if too_large:
            return "float32", Kind.TOO_LARGE, f"{too_large} does not fit float16 (largest 65504)"
        if self.pure:
            return half, Kind.UNIFORM, "pure half policy"
        if in_block and not layer.weights:
            # A block creates its weightless sublayers itself, with its own dtype, when it is built
            # or loaded: they follow their block, as a reload makes them.
            return None, Kind.IN_BLOCK, None
        if output and self.policy.output_dtype == "float32":
            if any(True for _ in walk(layer)):
                # Inside, a block adds and multiplies raw tensors, which must share one dtype.
                return half, Kind.HALF, "model output, but a block: keeps its dtype"
            if output == "listed" and isinstance(layer, _HALF_LAYERS) and float32_out.wrap(
                    getattr(layer, "activation", False)):
                # As TensorFlow's guide and torch autocast: the matmul in half, the output in float32.
                return half, Kind.HALF_OUT, "model output: matmul in half, activation and output float32"
            return "float32", Kind.OUTPUT, "model output"
        if re.search(r"Timestep|Sinusoid", type(layer).__name__):
            return "float32", Kind.ISLAND, "sinusoidal embedding: sin/cos of large arguments, 3 digits in half"
        if in_block and is_router(layer, parent):
            return "float32", Kind.ISLAND, "router of a mixture of experts: its softmax and top-k choose the experts"
        if _is_normalization(layer):
            dtype, reason = _place_normalization(layer, self.policy.compute_dtype) if in_block else (
                "float32", "normalization")
            return dtype, Kind.ISLAND, reason
        activation = _activation_name(layer)
        if activation in _FLOAT32_ACTIVATIONS:
            return "float32", Kind.FLOAT32_OP, f"{activation} activation"
        if type(layer) in safe_replacements() and not in_block:
            return half, Kind.SAFE_CLASS, "kmix safe layer"
        if isinstance(layer, keras.layers.Softmax) and not _is_kmix(layer):
            return "float32", Kind.FLOAT32_OP, "softmax"
        if isinstance(layer, _HALF_LAYERS):
            return half, Kind.HALF, "allow list"
        return half, Kind.HALF, "follows inputs"

    def _check_names(self, model, rows):
        unknown = sorted(self.names - {layer.name for _, layer, _ in rows} - {path for path, _, _ in rows})
        if unknown:
            raise ValueError(
                f"`float32_layers` names {unknown}, which are no layers of model {model.name!r}. "
                f"Its layers are: {sorted({layer.name for _, layer, _ in rows})}."
            )


class Kind(enum.Enum):
    """What a plan's row is, for the steps after the plan (the `reason` is prose, for the table)."""

    NAMED = "in float32_layers"
    KEPT = "inside a WithPolicy: its own policy kept"
    NESTED = "a nested model: its layers are placed"
    UNIFORM = "one policy for every layer (float32 or pure half)"
    IN_BLOCK = "a weightless layer a block makes: as its block makes it"
    OUTPUT = "produces a model output: float32"
    TOO_LARGE = "a variable beyond float16's range (65504): float32, so that no finite value becomes inf"
    HALF_OUT = "produces a model output: its matmul in half, its activation and output float32"
    ISLAND = "a float32 island of the rules (a norm, a router, a sinusoidal embedding): gives way to its block"
    FLOAT32_OP = "softmax / log-softmax: float32"
    SAFE_CLASS = "becomes kmix's class (Softmax, MultiHeadAttention)"
    HALF = "half: a matmul, or follows its inputs"


Row = collections.namedtuple("Row", "path layer dtype kind reason")
Row.__doc__ = """A plan's row: a layer's `path`, the `layer`, the Keras policy name planned for it
(None: keep its own), its `Kind` and the `reason` the table shows."""


class Plan(list):
    """`Rules.plan`'s `Row`s: the layer tree, walked once.

    Parents come before the layers inside them. The later steps of
    `kmix.autocast` (placing, repairing, the table) read the rows instead of
    walking the model again.
    """

    def path(self, layer):
        """`layer`'s path in the plan, or None for a layer outside it."""
        if not hasattr(self, "_paths"):
            self._paths = {id(row.layer): row.path for row in self}
        return self._paths.get(id(layer))

    def subtree(self, layer):
        """The layers inside `layer` (not itself), from the rows."""
        prefix = self.path(layer)
        if prefix is None:
            return [sub for _, sub, _ in walk(layer)]
        return [row.layer for row in self if row.path.startswith(prefix + "/")]


def _follow_block(layer, block, planned):
    """The policy of a weightless layer inside `block`: the block's, if the block gave it its own.

    A block passes its dtype to the layers it creates (`dtype=self.dtype_policy`),
    and a reload re-creates them so. One created with a dtype of its own
    (keras-hub's Llama attention makes its softmax float32) keeps it.
    """
    if resolved_policy(layer).name != resolved_policy(block).name:
        return None, "in a block: a dtype of its own, kept"
    dtype = planned.get(id(block))
    if dtype is None:
        return None, "in a block: as its block"
    return dtype, "in a block: follows it"


def _split_float32_layers(float32_layers):
    if float32_layers is None:
        return (), set()
    if isinstance(float32_layers, (str, type)):
        float32_layers = [float32_layers]
    if not isinstance(float32_layers, (list, tuple, set, frozenset)):
        raise TypeError(
            "`float32_layers` must be a list of layer classes and/or layer names. "
            f"Received: float32_layers={float32_layers!r} (of type {type(float32_layers).__name__})."
        )
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


def is_router(layer, block):
    """Whether `layer` is the router of a mixture-of-experts `block`: the projection to expert logits.

    Switch Transformer, DeepSpeed's `TopKGate` and Megatron-LM keep the router
    in float32: a half router's top-k flips experts, and the load-balancing
    loss sums its probabilities. Found by name, as keras-hub's MoE blocks
    call it: a `Dense` named `*gate*` or `*router*` (not an expert's gate)
    in a block named `*SparseMoe*` / `*MoEBlock*`, or any `Dense` in a
    `*Router` layer (GPT-OSS, Gemma 4).
    """
    if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        return False
    block_name, name = type(block).__name__, layer.name.lower()
    if re.search(r"Router$", block_name):
        return True
    moe_block = re.search(r"Sparse|Mo[Ee]Block|Mo[Ee]Layer", block_name) is not None
    return moe_block and re.search(r"gate|router", name) is not None and "expert" not in name


def _beyond_float16(layer, policy):
    """`"<variable> (|x| up to <max>)"` for the first own variable of `layer` float16 cannot hold, or None.

    Only under a policy that computes or stores in float16 (bfloat16 has
    float32's range). A finite value beyond 65504 would become inf there.
    """
    if "float16" not in (policy.compute_dtype, policy.params_dtype):
        return None
    for variable in own_weights(layer):
        dtype = keras.backend.standardize_dtype(variable.dtype)
        if not keras.backend.is_float_dtype(dtype) or 0 in tuple(variable.shape):
            continue
        largest = float(keras.ops.max(keras.ops.abs(keras.ops.cast(variable, "float32"))))
        if FLOAT16_MAX < largest < float("inf"):
            return f"{variable.name} (|x| up to {largest:.3g})"
    return None


FLOAT16_MAX = 65504.0


def _is_normalization(layer):
    """Keras's normalization layers, and other libraries' by name (keras-hub's `LlamaLayerNorm`)."""
    return isinstance(layer, _NORMALIZATION) or "Norm" in type(layer).__name__


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
