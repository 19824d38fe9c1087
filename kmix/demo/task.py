"""The demo's task: padded token sequences labelled by their most frequent marker, and an encoder to classify them."""

import math

import keras
import numpy as np

import kmix

VOCAB = 48  # token 0 is padding; 1..CLASSES are the markers; the rest are distractors
CLASSES = 6
MAX_LEN = 64
MIN_LEN = 6


def make_data(n, seed):
    """`n` padded sequences and their labels: the marker token that occurs most often (a strict majority).

    Returns:
        `(tokens, labels)`: int32 arrays of shapes `(n, MAX_LEN)` and `(n,)`; token 0 pads.
    """
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, MAX_LEN), np.int32)
    labels = rng.integers(0, CLASSES, size=n).astype(np.int32)
    for i in range(n):
        counts = rng.integers(0, 2, size=CLASSES)
        counts[labels[i]] = counts.max() + 1
        markers = np.repeat(np.arange(1, CLASSES + 1), counts)
        length = rng.integers(max(MIN_LEN, len(markers)), MAX_LEN + 1)
        seq = rng.integers(CLASSES + 1, VOCAB, size=length)
        seq[rng.choice(length, size=len(markers), replace=False)] = markers
        tokens[i, :length] = seq
    return tokens, labels


def build_model(softmax, d_model=64, heads=4, layers=2, seed=0):
    """The uncompiled encoder classifier (token ids to float32 class probabilities) under the current policy.

    Args:
        softmax: `"naive"` for the hand-written `-1e9` mask, `"kmix"` for `kmix.layers.MaskedSoftmax`.
        d_model, heads, layers: the encoder's width, heads and depth.
        seed: the initial weights' seed (the same for every run).
    """
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((MAX_LEN,), dtype="int32", name="tokens")
    mask = keras.ops.not_equal(tokens, 0)
    x = keras.layers.Embedding(VOCAB, d_model, name="embed")(tokens)
    x = _PositionEmbedding(name="position")(x)
    for i in range(layers):
        h = keras.layers.LayerNormalization(name=f"ln_a{i}")(x)
        x = x + _Attention(d_model, heads, softmax, name=f"attention{i}")(h, mask)
        h = keras.layers.LayerNormalization(name=f"ln_f{i}")(x)
        h = keras.layers.Dense(2 * d_model, activation="gelu", name=f"ff_in{i}")(h)
        x = x + keras.layers.Dense(d_model, name=f"ff_out{i}")(h)
    x = keras.layers.LayerNormalization(name="ln_out")(x)
    x = _MaskedMean(name="pool")(x, mask)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", dtype="float32", name="classes")(x)
    return keras.Model(tokens, outputs, name=f"encoder_{softmax}")


class _Attention(keras.layers.Layer):
    """Self-attention written out, with the softmax the run asks for."""

    def __init__(self, d_model, heads, softmax, **kwargs):
        super().__init__(**kwargs)
        self.d_model, self.heads, self.softmax = d_model, heads, softmax
        self.qkv = keras.layers.Dense(3 * d_model, name="qkv")
        self.out = keras.layers.Dense(d_model, name="out")
        self.masked_softmax = kmix.layers.MaskedSoftmax(axis=-1, name="softmax")

    def call(self, x, mask):
        ops = keras.ops
        b, t, head_dim = ops.shape(x)[0], ops.shape(x)[1], self.d_model // self.heads
        qkv = ops.reshape(self.qkv(x), (b, t, 3, self.heads, head_dim))
        q, k, v = (ops.transpose(qkv[:, :, j], (0, 2, 1, 3)) for j in range(3))
        scores = ops.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(head_dim)
        keep = mask[:, None, None, :]
        if self.softmax == "naive":
            # What tutorials write; in float16, -1e9 is -inf and 0 * -inf is NaN.
            keep = ops.cast(keep, scores.dtype)
            probs = ops.softmax(scores + (1.0 - keep) * -1e9, axis=-1)
        else:
            probs = self.masked_softmax(scores, mask=keep)
        out = ops.einsum("bhqk,bhkd->bqhd", probs, v)
        return self.out(ops.reshape(out, (b, t, self.d_model)))


class _PositionEmbedding(keras.layers.Layer):
    """Adds a trained embedding of each position."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="embeddings")

    def call(self, x):
        return x + self.table[None]


class _MaskedMean(keras.layers.Layer):
    """Mean over the unpadded positions."""

    def call(self, x, mask):
        keep = keras.ops.cast(mask, x.dtype)[..., None]
        return keras.ops.sum(x * keep, axis=1) / keras.ops.maximum(keras.ops.sum(keep, axis=1), 1)
