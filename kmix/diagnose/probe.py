"""What every layer of a model outputs, and the gradients flowing into it: per-layer hooks and statistics."""

import collections
import contextlib
import dataclasses
import functools

import keras
import numpy as np
import tensorflow as tf

from kmix import _compat
from kmix._tree import walk

HalfRange = collections.namedtuple("HalfRange", "max min_normal min_subnormal")
HALF_RANGES = {"float16": HalfRange(65504.0, 2.0**-14, 2.0**-24),
               "bfloat16": HalfRange(float(tf.bfloat16.max), 2.0**-126, 2.0**-133)}
# Why a layer belongs in float32, in the words of the table and the PNG.
VERDICTS = {"error": "raises in half precision", "mask": "-inf constant (mask)", "inside": "overflows inside",
            "output": "output overflows", "input": "input overflows"}


@dataclasses.dataclass(eq=False)
class LayerNode:
    """One layer of the model's tree; `parent` is None at the top.

    `target`: the name `kmix.autocast(float32_layers=...)` accepts, the layer's own where it is in a `.layers`
    of the model or a nested model, else its nearest such ancestor's. `kept`: keeps its own policy in the
    half run (a `kmix.layers.WithPolicy` or inside one).
    """

    layer: object
    path: str
    target: str
    parent: "LayerNode"
    kept: bool

    def ancestors(self):
        """The enclosing nodes, innermost first."""
        node = self.parent
        while node is not None:
            yield node
            node = node.parent


def layer_nodes(model):
    """Every layer inside `model` (`kmix._tree.walk`'s order) as a `LayerNode`."""
    from kmix.layers import WithPolicy

    addressable, models = set(), [model]
    while models:
        for layer in models.pop().layers:
            addressable.add(id(layer))
            if isinstance(layer, keras.Model):
                models.append(layer)
    nodes = {}
    for path, layer, parent in walk(model):
        up = nodes.get(id(parent))
        target = layer.name if id(layer) in addressable or up is None else up.target
        kept = isinstance(layer, WithPolicy) or (up is not None and up.kept)
        nodes[id(layer)] = LayerNode(layer, path, target, up, kept)
    return list(nodes.values())


@contextlib.contextmanager
def patched_calls(nodes, hook, start=None):
    """Within the block, each eager call of a node's layer runs `hook(node, args, kwargs, outputs)`.

    `start(node)`, if given, runs as each such call begins (a block before its sub-layers); traced calls are not seen.
    """

    def make_call(layer, i):
        original, node = layer.call, nodes[i]

        @functools.wraps(original)
        def call(*args, **kwargs):
            if start is not None and tf.executing_eagerly():
                start(node)
            outputs = original(*args, **kwargs)
            if tf.executing_eagerly():
                hook(node, args, kwargs, outputs)
            return outputs

        return call

    with _compat.calls_replaced([node.layer for node in nodes], make_call):
        yield


def floating(structure):
    """The floating-point tensors in a nested structure, each once."""
    found = {}
    for t in keras.tree.flatten(structure):
        if isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype.is_floating:
            found.setdefault(id(t), t)
    return list(found.values())


def max_finite(tensor):
    """The largest finite |value| of `tensor` (0.0 when it has none)."""
    a = tf.abs(tf.cast(tensor, tf.float32))
    return float(tf.reduce_max(tf.where(tf.math.is_finite(a), a, 0.0))) if a.shape.num_elements() else 0.0


class TensorStats:
    """Running counts over floating tensors against a half dtype's range, and `max_abs`, the largest finite |value|.

    Of the `size` values seen: `nonzero` (finite), `nonfinite`, `overflow` (finite, inf once cast), `underflow`
    (nonzero, 0 once cast).
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
        counts = tf.stack([tf.size(a, out_type=tf.int64), tf.math.count_nonzero(nonzero),
                           tf.math.count_nonzero(~finite), tf.math.count_nonzero(finite & tf.math.is_inf(h)),
                           tf.math.count_nonzero(nonzero & tf.equal(h, 0))]).numpy()
        for name, count in zip(self.__slots__, counts):
            setattr(self, name, getattr(self, name) + int(count))
        self.max_abs = max(self.max_abs, max_finite(a))
        return tf.boolean_mask(a, nonzero).numpy() if values else None

    def fraction(self, count):
        """`count` over the values seen (0.0 when none)."""
        return count / self.size if self.size else 0.0


class Log2Histogram:
    """Counts of nonzero |values| by log2, `BINS_PER_OCTAVE` bins per power of two (edges on exact powers)."""

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
        k = int(np.floor((log2_threshold - self.LOW) * self.BINS_PER_OCTAVE + 1e-9))
        return float(self.counts[: max(0, k)].sum()) / self.total if self.total else 0.0

    def fraction_above(self, log2_threshold):
        """The fraction of values whose bin lies wholly at or above 2^`log2_threshold`."""
        k = int(np.ceil((log2_threshold - self.LOW) * self.BINS_PER_OCTAVE - 1e-9))
        return float(self.counts[max(0, k):].sum()) / self.total if self.total else 0.0


def percent(fraction, zero="0"):
    """A fraction as a short percentage for tables: `zero` (`"0"`), `<0.01%`, `0.5%`, `12%`."""
    if fraction == 0:
        return zero
    if fraction < 1e-4:
        return "<0.01%"
    return f"{100 * fraction:.2g}%" if fraction < 0.1 else f"{100 * fraction:.0f}%"
