"""What every layer of a model outputs, and the gradients flowing into it.

A probe replaces `layer.call` on the layer *instance* (never its class) with
a wrapper that hands the call's inputs and outputs to a hook, for every
layer of the model, nested ones included (the layers inside a custom layer,
a nested model or a keras-hub backbone). `patched_calls` puts every
original back in a `finally`, so the model is left exactly as it was.
"""

import collections
import contextlib
import functools

import keras
import numpy as np
import tensorflow as tf

from kmix import _compat

HalfRange = collections.namedtuple("HalfRange", "max min_normal min_subnormal")
HALF_RANGES = {
    "float16": HalfRange(65504.0, 2.0**-14, 2.0**-24),
    "bfloat16": HalfRange(float(tf.bfloat16.max), 2.0**-126, 2.0**-133),
}


class LayerNode:
    """One layer of the model's tree.

    Attributes:
        layer: the layer.
        path: its place in the tree, `"attention0/qkv"`.
        target: the name `kmix.autocast(float32_layers=...)` accepts for it:
            its own name when the layer is in a `model.layers` (of the model
            or of a nested model), else its nearest such ancestor's.
        parent: the enclosing `LayerNode`, or None at the top.
        kept: whether the layer is a `kmix.layers.WithPolicy` or inside one:
            it keeps its own policy in the half-precision run.
    """

    __slots__ = ("layer", "path", "target", "parent", "kept")

    def __init__(self, layer, path, target, parent, kept):
        self.layer, self.path, self.target, self.parent, self.kept = layer, path, target, parent, kept

    def ancestors(self):
        """The enclosing nodes, innermost first."""
        node = self.parent
        while node is not None:
            yield node
            node = node.parent


def layer_tree(model):
    """Every layer inside `model` (not `model` itself, nor input layers) as `LayerNode`s, depth first."""
    from kmix.layers import WithPolicy

    addressable = set()

    def collect(m):
        for layer in m.layers:
            addressable.add(id(layer))
            if isinstance(layer, keras.Model):
                collect(layer)

    collect(model)
    nodes, seen = [], {id(model)}

    def walk(layer, parent, prefix, kept):
        for sub in _compat.sublayers(layer):
            if id(sub) in seen or isinstance(sub, keras.layers.InputLayer):
                continue
            seen.add(id(sub))
            target = sub.name if id(sub) in addressable else parent.target if parent else sub.name
            node = LayerNode(sub, prefix + sub.name, target, parent, kept or isinstance(sub, WithPolicy))
            nodes.append(node)
            walk(sub, node, node.path + "/", node.kept)

    walk(model, None, "", False)
    return nodes


@contextlib.contextmanager
def patched_calls(nodes, hook, start=None):
    """Within the block, each eager call of a node's layer runs `hook(node, args, kwargs, outputs)`.

    `start(node)`, if given, runs as each such call begins (a block starts
    before its sub-layers, and ends after them).
    Calls made while tracing a graph (symbolic tensors, `tf.function`) are
    not reported. Every layer's own `call` is restored on exit.
    """
    with wrapped_calls([node.layer for node in nodes],
                       lambda layer, i: _wrap(layer.call, nodes[i], hook, start)):
        yield


@contextlib.contextmanager
def wrapped_calls(layers, make_call):
    """Within the block, `layers[i].call` is `make_call(layers[i], i)`; each layer's own is put back on exit."""
    missing = object()
    saved = []
    try:
        for i, layer in enumerate(layers):
            saved.append((layer, vars(layer).get("call", missing)))
            layer.call = make_call(layer, i)
        yield
    finally:
        for layer, own in reversed(saved):
            if own is missing:
                vars(layer).pop("call", None)  # absent where an interrupt came before it was set
            else:
                layer.call = own


def _wrap(original, node, hook, start):
    @functools.wraps(original)
    def call(*args, **kwargs):
        if start is not None and tf.executing_eagerly():
            start(node)
        outputs = original(*args, **kwargs)
        if tf.executing_eagerly():
            hook(node, args, kwargs, outputs)
        return outputs

    return call


@contextlib.contextmanager
def layer_policies(nodes, policy_of):
    """Within the block each node's layer has the dtype policy `policy_of(node)` (None: unchanged)."""
    saved = []
    try:
        for node in nodes:
            policy = policy_of(node)
            if policy is not None:
                saved.append((node.layer, node.layer.dtype_policy))
                node.layer.dtype_policy = policy
        yield
    finally:
        for layer, policy in reversed(saved):
            layer.dtype_policy = policy


def floating(structure):
    """The floating-point tensors in a nested structure, each once."""
    found, seen = [], set()
    for t in keras.tree.flatten(structure):
        if isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype.is_floating and id(t) not in seen:
            seen.add(id(t))
            found.append(t)
    return found


class TensorStats:
    """Running counts over floating tensors, against a half dtype's range.

    Attributes:
        size: values seen.
        nonzero: finite nonzero values.
        nonfinite: inf or NaN values.
        overflow: finite values that are inf once cast to the half dtype.
        underflow: nonzero values that are 0 once cast to the half dtype.
        max_abs: the largest finite |value| (0.0 when none).
    """

    __slots__ = ("size", "nonzero", "nonfinite", "overflow", "underflow", "max_abs")

    def __init__(self):
        self.size = self.nonzero = self.nonfinite = self.overflow = self.underflow = 0
        self.max_abs = 0.0

    def add(self, tensor, half, values=True):
        """Counts `tensor`'s values; returns its finite nonzero |values| (NumPy), or None if not `values`."""
        a = tf.abs(tf.cast(tensor, tf.float32))
        finite = tf.math.is_finite(a)
        h = tf.cast(a, half)
        nonzero = finite & (a > 0)
        counts = tf.stack([
            tf.size(a, out_type=tf.int64),
            tf.math.count_nonzero(nonzero),
            tf.math.count_nonzero(~finite),
            tf.math.count_nonzero(finite & tf.math.is_inf(h)),
            tf.math.count_nonzero(nonzero & tf.equal(h, 0)),
        ]).numpy()
        self.size += int(counts[0])
        self.nonzero += int(counts[1])
        self.nonfinite += int(counts[2])
        self.overflow += int(counts[3])
        self.underflow += int(counts[4])
        self.max_abs = max(self.max_abs, float(tf.reduce_max(tf.where(finite, a, 0.0))) if self.size else 0.0)
        return tf.boolean_mask(a, nonzero).numpy() if values else None

    def fraction(self, count):
        """`count` over the values seen (0.0 when none)."""
        return count / self.size if self.size else 0.0


class Log2Histogram:
    """Counts of nonzero |values| by log2, `BINS_PER_OCTAVE` bins per power of two.

    Bin edges fall on exact powers of two, so the fraction of values below a
    power of two (what flushes to zero in float16 at a power-of-two loss
    scale) is exact; other thresholds are resolved to 1/16 of an octave.
    """

    BINS_PER_OCTAVE = 16
    LOW, HIGH = -150, 129  # float32 runs from 2^-149 (subnormal) to below 2^128

    def __init__(self):
        self.counts = np.zeros((self.HIGH - self.LOW) * self.BINS_PER_OCTAVE, np.int64)

    @property
    def edges(self):
        """The bin edges in log2 units (one more than `counts`)."""
        return self.LOW + np.arange(self.counts.size + 1) / self.BINS_PER_OCTAVE

    @property
    def total(self):
        return int(self.counts.sum())

    def add(self, values):
        """Counts the positive finite `values` (a NumPy array)."""
        mantissa, exponent = np.frexp(np.asarray(values, np.float64))  # value = m * 2^e, m in [0.5, 1)
        fine = np.floor(np.log2(2.0 * mantissa) * self.BINS_PER_OCTAVE).astype(np.int64)
        index = (exponent.astype(np.int64) - 1 - self.LOW) * self.BINS_PER_OCTAVE + np.minimum(fine, 15)
        np.add.at(self.counts, np.clip(index, 0, self.counts.size - 1), 1)

    def fraction_below(self, log2_threshold):
        """The fraction of values whose bin lies wholly below 2^`log2_threshold`."""
        if not self.total:
            return 0.0
        k = int(np.floor((log2_threshold - self.LOW) * self.BINS_PER_OCTAVE + 1e-9))
        return float(self.counts[: max(0, k)].sum()) / self.total

    def fraction_above(self, log2_threshold):
        """The fraction of values whose bin lies wholly at or above 2^`log2_threshold`."""
        if not self.total:
            return 0.0
        k = int(np.ceil((log2_threshold - self.LOW) * self.BINS_PER_OCTAVE - 1e-9))
        return float(self.counts[max(0, k):].sum()) / self.total


def percent(fraction):
    """A fraction as a short percentage for tables: `0`, `<0.01%`, `0.5%`, `12%`."""
    if fraction == 0:
        return "0"
    if fraction < 1e-4:
        return "<0.01%"
    return f"{100 * fraction:.2g}%" if fraction < 0.1 else f"{100 * fraction:.0f}%"
