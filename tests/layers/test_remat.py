"""`kmix.layers.Remat`: the same loss and gradients as the plain block, with less memory.

The reference is the same block, same weights and seeds, called without the
wrapper; memory is TensorFlow's allocator statistics on the CPU.
"""

import os
import tempfile

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix.benchmarks.memory import Block


def encoder_block():
    keras.utils.set_random_seed(0)
    return keras_hub.layers.TransformerEncoder(32, 2, dropout=0.3, name="encoder")


def block_inputs():
    x = tf.random.stateless_normal((2, 8, 32), seed=(1, 2))
    lengths = np.array([[8], [5]])
    attention_mask = tf.constant(np.arange(8)[None, None, :] < lengths[:, :, None])  # (2, 1, 8) bool
    attention_mask = tf.broadcast_to(attention_mask, (2, 8, 8))
    return x, attention_mask


def loss_and_grads(layer, block, x, attention_mask):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, attention_mask=attention_mask, padding_mask=None, training=True)
        loss = tf.reduce_sum(tf.cast(y, "float32") ** 2)
    return loss, tape.gradient(loss, [x] + block.trainable_variables)


@pytest.mark.parametrize("mode", ["eager", "xla"])
def test_same_loss_and_gradients_with_dropout_and_a_keyword_mask(mode):
    keras.config.set_dtype_policy("mixed_float16")
    x, attention_mask = block_inputs()
    results = []
    for remat in (False, True):
        block = encoder_block()
        layer = kmix.layers.Remat(block) if remat else block
        layer(x, attention_mask=attention_mask)  # builds
        fn = loss_and_grads if mode == "eager" else tf.function(loss_and_grads, jit_compile=True)
        steps = [fn(layer, block, x, attention_mask) for _ in range(2)]  # the seeds move between steps
        seeds = [keras.ops.convert_to_numpy(v) for v in block.variables if not v.trainable]
        results.append((steps, seeds))
    (plain, plain_seeds), (remat, remat_seeds) = results
    assert plain_seeds and all(np.array_equal(a, b) for a, b in zip(plain_seeds, remat_seeds))
    assert float(plain[0][0]) != float(plain[1][0])  # dropout is active
    for (loss_a, grads_a), (loss_b, grads_b) in zip(plain, remat):
        assert float(loss_a) == float(loss_b)
        assert len(grads_b) == 1 + len(block.trainable_variables) and all(g is not None for g in grads_b)
        for a, b in zip(grads_a, grads_b):
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))


@keras.saving.register_keras_serializable(package="kmix_tests_remat")
class MaskedResidual(keras.layers.Layer):
    """A small block with a keyword mask and dropout: LayerNorm(x + mask * Dropout(Dense(x))).

    The `fit` tests wrap this rather than a TransformerEncoder (which the tests
    above and below wrap): tracing a train step of it costs half as much, and
    Remat does the same for any layer: the keyword tensor, the seed, the recompute.
    """

    def __init__(self, units, rate, **kwargs):
        super().__init__(**kwargs)
        self.units, self.rate = units, rate
        self.dense = keras.layers.Dense(units, activation="relu", dtype=self.dtype_policy)
        self.dropout = keras.layers.Dropout(rate, dtype=self.dtype_policy)
        self.norm = keras.layers.LayerNormalization(dtype=self.dtype_policy)

    def build(self, x_shape, padding_mask_shape=None):
        self.dense.build(x_shape)
        self.norm.build(x_shape)

    def call(self, x, padding_mask=None, training=None):
        h = self.dropout(self.dense(x), training=training)
        if padding_mask is not None:
            h = h * keras.ops.cast(padding_mask, h.dtype)[..., None]
        return self.norm(x + h)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "rate": self.rate}


def small_model(remat, vocab=50, seq=8):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq,), dtype="int32")
    mask = keras.Input((seq,), dtype="int32")  # MirroredStrategy's fit cannot split bool inputs
    x = keras.layers.Embedding(vocab, 32)(tokens)
    block = MaskedResidual(32, 0.1)
    x = (kmix.layers.Remat(block) if remat else block)(x, padding_mask=mask)
    x = keras.layers.GlobalAveragePooling1D()(x)
    out = keras.layers.Dense(1, dtype="float32")(x)
    return keras.Model([tokens, mask], out)


def small_data(n=8, vocab=50, seq=8):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (n, seq)).astype(np.int32)
    mask = (np.arange(seq)[None] < rng.integers(3, seq + 1, (n, 1))).astype(np.int32)
    return (tokens, mask), rng.normal(size=(n, 1)).astype(np.float32)


def test_fit_under_o2_with_accumulation_and_masters_then_save_and_load():
    x, y = small_data()
    weights = []
    for remat in (False, True):
        with kmix.policy_scope("O2"):
            model = small_model(remat)
            model.compile(optimizer=kmix.wrap(keras.optimizers.Adam(1e-2), accumulation_steps=2),
                          loss="mse", jit_compile=False)
            model.optimizer.build(model.trainable_variables)  # built before fit: one trace of the train step, not two
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        assert model.optimizer.master_weights is True
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    assert isinstance(loaded.layers[3], kmix.layers.Remat)
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(model(x)))
    config = kmix.layers.Remat.from_config(model.layers[3].get_config()).get_config()
    assert config == model.layers[3].get_config()


def test_mirrored_strategy_gives_the_plain_weights():
    strategy = two_replicas()
    x, y = small_data()
    weights = []
    for remat in (False, True):
        with strategy.scope():
            model = small_model(remat)
            model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(1e-2)), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def peak_bytes_of_a_train_step(remat, blocks=3, batch=8, seq=128, d_model=128):
    keras.utils.set_random_seed(0)
    layers = [Block(d_model, 4) for _ in range(blocks)]
    layers = [kmix.layers.Remat(b) for b in layers] if remat else layers
    x = tf.random.stateless_normal((batch, seq, d_model), seed=(0, 1))
    for layer in layers:
        layer(x)
    variables = [v for layer in layers for v in layer.trainable_variables]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for layer in layers:
                h = layer(h, training=True)
            loss = tf.reduce_mean(h**2)
        return tape.gradient(loss, variables)

    step(x)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    grads = step(x)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    return peak, grads


def test_peak_memory_of_a_three_block_train_step_is_lower():
    plain, plain_grads = peak_bytes_of_a_train_step(False)
    remat, remat_grads = peak_bytes_of_a_train_step(True)
    for a, b in zip(plain_grads, remat_grads):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), rtol=1e-4, atol=1e-6)
    # A block keeps about a dozen activations of its input's size and its attention
    # probabilities; with Remat only the inputs of the blocks and one block's worth
    # (measured: 49 MiB plain, 22 MiB with Remat; 63 and 23 with four blocks).
    print(f"peak of a 3-block train step: {plain / 2**20:.1f} MiB plain, {remat / 2**20:.1f} MiB with Remat")
    assert remat < 0.6 * plain, (remat, plain)


def test_bad_arguments():
    with pytest.raises(TypeError, match="layer"):
        kmix.layers.Remat("dense")
    with pytest.raises(ValueError, match="dtype"):
        kmix.layers.Remat(keras.layers.Dense(2), dtype="float16")


def test_a_dtype_in_the_config_goes_to_the_wrapped_layer():
    """What `kmix.autocast` and `clone_model` do: re-create a layer with `dtype` set in its config."""
    remat = kmix.layers.Remat(encoder_block())
    x, _ = block_inputs()
    remat(x)
    config = remat.get_config()
    assert "dtype" not in config
    clone = kmix.layers.Remat.from_config({**config, "dtype": "mixed_bfloat16"})
    assert clone.layer.dtype_policy.name == "mixed_bfloat16" and clone.dtype_policy.name == "mixed_bfloat16"
    assert clone(x).dtype == "bfloat16"


def two_replicas():
    """MirroredStrategy over the two logical CPUs of tests/conftest.py.

    Reduction to one device, not collectives: TensorFlow numbers the collective
    instances of every MirroredStrategy in a process alike, and two strategies
    whose reductions have different shapes then abort each other.
    """
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_decoder_with_a_padding_mask_and_python_keywords_matches_the_bare_decoder(mode):
    """`use_causal_mask=True` / `training=False` next to a tensor mask: bound one by one, as unwrapped."""
    x = tf.random.stateless_normal((2, 8, 32), seed=(3, 4))
    padding_mask = tf.constant(np.arange(8)[None, :] < np.array([[8], [5]]))
    keras.utils.set_random_seed(0)
    decoder = keras_hub.layers.TransformerDecoder(32, 2, dropout=0.2, name="decoder")
    wrapped = kmix.layers.Remat(decoder)
    decoder(x, decoder_padding_mask=padding_mask)  # builds

    def loss_and_grads(layer, training):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, decoder_padding_mask=padding_mask, use_causal_mask=True, training=training)
            loss = tf.reduce_sum(y * tf.range(32, dtype=y.dtype))
        return y, tape.gradient(loss, [x] + decoder.trainable_variables)

    fn = loss_and_grads if mode == "eager" else tf.function(loss_and_grads)
    for training in (False, True):
        seeds = [v.numpy() for v in decoder.non_trainable_variables]
        y_plain, g_plain = fn(decoder, training)
        for v, value in zip(decoder.non_trainable_variables, seeds):
            v.assign(value)  # the same dropout masks for the wrapped call
        y_remat, g_remat = fn(wrapped, training)
        np.testing.assert_allclose(y_remat.numpy(), y_plain.numpy(), rtol=1e-6, atol=1e-6)
        assert all(g is not None for g in g_remat)
        for a, b in zip(g_plain, g_remat):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
    # The causal mask is in force: the first position does not see the later ones.
    y_first = fn(wrapped, False)[0][:, 0]
    x_changed = tf.concat([x[:, :1], x[:, 1:] + 1.0], axis=1)
    y_changed = wrapped(x_changed, decoder_padding_mask=padding_mask, use_causal_mask=True)[:, 0]
    np.testing.assert_allclose(y_changed.numpy(), y_first.numpy(), rtol=1e-6, atol=1e-6)
