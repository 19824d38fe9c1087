"""The GPT-style decoder the speed benchmarks train, its model FLOPs (PaLM's convention) and its data."""

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix.benchmarks.common import steady


@keras.saving.register_keras_serializable(package="kmix_benchmarks")  # autocast checks the model reloads
class PositionEmbedding(keras.layers.Layer):
    """Adds a trained embedding of each position to `(batch, seq, d_model)` inputs."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="embeddings")

    def call(self, x):
        return x + self.table[None]


def build_model(layers, d_model, heads, seq, vocab, stack, block=None, name=None):
    """The uncompiled GPT under the current policy, `stack`'s attention; `block(i, x)`, if given, adds block i."""
    attention = kmix.layers.MultiHeadAttention if stack == "kmix" else keras.layers.MultiHeadAttention
    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, d_model, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    for i in range(layers):
        if block is not None:
            x = block(i, x)
            continue
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln_attn{i}")(x)
        x = x + attention(heads, d_model // heads, name=f"attention{i}")(h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln_mlp{i}")(x)
        h = keras.layers.Dense(4 * d_model, activation="gelu", name=f"mlp_in{i}")(h)
        x = x + keras.layers.Dense(d_model, name=f"mlp_out{i}")(h)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_final")(x)
    logits = keras.layers.Dense(vocab, name="lm_head")(x)
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(logits)  # the loss in float32
    return keras.Model(tokens, logits, name=name or f"gpt_{stack}")


def model_flops_per_token(model, layers, d_model, seq):
    """PaLM's model FLOPs per trained token: `6 * N + 12 * layers * d_model * seq`, N without the embeddings."""
    embeddings = sum(int(np.prod(w.shape)) for layer in model.layers if "embedding" in layer.name
                     for w in layer.trainable_weights)
    n = sum(int(np.prod(w.shape)) for w in model.trainable_weights) - embeddings
    return 6 * n + 12 * layers * d_model * seq


def make_dataset(batch, seq, vocab):
    """One random batch of tokens and next tokens, repeated forever, as a `tf.data.Dataset`."""
    tokens = np.random.default_rng(0).integers(0, vocab, size=(batch, seq + 1)).astype(np.int32)
    return steady(tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat())
