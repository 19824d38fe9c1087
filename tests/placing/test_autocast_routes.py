"""autocast on the routes users take with their own objects: transfer learning, LoRA, custom layers.

The model is placed in place, so the user's handles (a frozen `base_model`,
a LoRA-enabled backbone, an unregistered custom layer) keep working on the
model that trains. Each test compares with the float32 model or with what
plain Keras does on the same route.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from tests.testing import full_only

TOLERANCE = {"float16": 3e-2, "bfloat16": 1.2e-1}  # of the float32 output's largest value


def _numpy(x):
    return keras.ops.convert_to_numpy(x).astype("float64")


def _transfer_model():
    """keras.io's transfer-learning guide in small: a frozen base model under a new head."""
    base_model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.BatchNormalization(),
         keras.layers.Dense(16, activation="relu")], name="base_model")
    base_model.trainable = False
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1, name="head")(base_model(inputs, training=False))
    return keras.Model(inputs, outputs), base_model


def test_transfer_learning_guide_unchanged():
    """Freeze, train, unfreeze, recompile, fine-tune: as the float32 model (plain Keras, run eagerly) does."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = x[:, :1] * 2.0
    reference, reference_base = _transfer_model()
    model, base_model = _transfer_model()
    model.set_weights(reference.get_weights())

    model = kmix.autocast(model, "O1")  # the user's `base_model` handle is a layer of this model
    assert model.get_layer("base_model") is base_model

    def compile_for(m, rate):
        if m is reference:
            m.compile(optimizer=keras.optimizers.Adam(rate), loss="mse", run_eagerly=True)
            return
        with kmix.policy_scope("O1"):
            m.compile(optimizer=kmix.wrap(keras.optimizers.Adam(rate)), loss="mse")
        m.optimizer.build(m.trainable_variables)  # built before fit: one trace of the train step, not two

    for m, base in ((model, base_model), (reference, reference_base)):
        compile_for(m, 1e-3)
        frozen = [_numpy(v) for v in base.weights]
        m.fit(x, y, batch_size=32, epochs=1, verbose=0)
        assert all(np.array_equal(_numpy(v), w) for v, w in zip(base.weights, frozen))  # frozen: unchanged
        base.trainable = True  # unfreeze through the handle, recompile, fine-tune
        compile_for(m, 1e-5)
        m.fit(x, y, batch_size=32, epochs=1, verbose=0)
        assert any(not np.array_equal(_numpy(v), w) for v, w in zip(base.trainable_weights, frozen))
    assert len(model.trainable_weights) == len(reference.trainable_weights) == 8
    np.testing.assert_allclose(_numpy(model(x)), _numpy(reference(x)), atol=TOLERANCE["float16"] * np.abs(_numpy(reference(x))).max())


def test_lora_backbone_keeps_its_adapters():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.BertBackbone(vocabulary_size=40, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=8)
    backbone.enable_lora(2)
    trainable = list(backbone.trainable_weights)
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, 40, (2, 8)).astype("int32"), "segment_ids": np.zeros((2, 8), "int32"),
         "padding_mask": np.ones((2, 8), "int32")}
    expected = _numpy(backbone(x)["sequence_output"])
    assert kmix.autocast(backbone, "O1") is backbone
    assert list(backbone.trainable_weights) == trainable  # the same variables train, adapters included
    adapters = [v for v in trainable if "lora" in v.path]
    assert adapters and all(v.dtype == "float32" for v in adapters)
    got = _numpy(backbone(x)["sequence_output"])
    np.testing.assert_allclose(got, expected, atol=TOLERANCE["float16"] * np.abs(expected).max())


class Sampling(keras.layers.Layer):
    """keras.io's VAE sampling layer, with a raw TensorFlow op (not registered, not serializable)."""

    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = tf.random.normal(tf.shape(z_mean), seed=1)  # float32, whatever the layer computes in
        return z_mean + tf.exp(0.5 * z_log_var) * epsilon


def test_custom_layer_that_fails_in_half_is_kept_in_float32():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    z_mean = keras.layers.Dense(2, name="z_mean")(h)
    z_log_var = keras.layers.Dense(2, name="z_log_var")(h)
    z = Sampling(name="sampling")([z_mean, z_log_var])
    model = keras.Model(inputs, [z_mean, keras.layers.Dense(8, name="decoder")(z)])
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    expected = _numpy(model(x)[0])
    with pytest.warns(UserWarning, match=r"kept \['sampling'\] in float32"):
        new, table = kmix.autocast(model, "O1", return_table=True)
    row = {r.layer: r for r in table}["sampling"]
    assert row.after == "float32" and row.reason.startswith("fails in half"), row
    assert new.get_layer("hidden").compute_dtype == "float16"
    got = new(x)
    np.testing.assert_allclose(_numpy(got[0]), expected, atol=TOLERANCE["float16"] * np.abs(expected).max())
    assert np.isfinite(_numpy(got[1])).all()


def test_a_class_that_drops_dtype_from_its_config_is_named():
    class Block(keras.layers.Layer):
        """Builds its dense layer with its own dtype, and leaves `dtype` out of its config."""

        def __init__(self, units=4, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.dense = keras.layers.Dense(units, dtype=self.dtype_policy, name="dense")

        def call(self, x):
            return self.dense(x)

        def get_config(self):
            config = super().get_config()
            config.pop("dtype")
            return dict(config, units=self.units)

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(Block(name="block")(inputs)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kmix.autocast(model, "O1")
    messages = [str(w.message) for w in caught if "kmix.autocast" in str(w.message)]
    assert len(messages) == 1 and "block/dense" in messages[0] and "load_model" in messages[0], messages
    assert model.get_layer("block").dense.compute_dtype == "float16"  # placed in memory all the same


@pytest.mark.parametrize("level", ["O1"] + [pytest.param(level, marks=full_only("about 11 s on 2 cores"))
                                             for level in ("O2", "mixed_bfloat16")])
def test_subclassed_model_trains_with_xla_like_float32(level):
    """The placed model under XLA reaches the loss the float32 model reaches (plain Keras, run eagerly)."""

    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(32, activation="relu")
            self.norm = keras.layers.LayerNormalization()
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.norm(self.hidden(x)))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = (x[:, :1] - x[:, 1:2]).astype("float32")
    models = []
    for placed in (False, True):
        keras.utils.set_random_seed(0)
        net = Net(name="net")
        net(x[:2])
        if placed:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the reload warning: a subclassed model rebuilds its layers
                assert kmix.autocast(net, level) is net
        if placed:
            with kmix.policy_scope(level):
                net.compile(optimizer=kmix.wrap(keras.optimizers.Adam(1e-2)), loss="mse", jit_compile=True)
            net.optimizer.build(net.trainable_variables)
        else:
            net.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", run_eagerly=True)
        models.append(net.fit(x, y, batch_size=32, epochs=6, shuffle=False, verbose=0).history["loss"])
    reference, got = models
    # An easy regression: both reach the same loss, whatever the CPU's half kernels.
    assert np.isfinite(got).all() and got[-1] < 0.3 * got[0]
    np.testing.assert_allclose(got[-1], reference[-1], rtol=0.5, atol=0.02)


class KerasIOSampling(keras.layers.Layer):
    """keras.io's VAE sampling layer, verbatim: `*` between a half tensor and float32 noise fails."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = keras.ops.shape(z_mean)[0]
        dim = keras.ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    """keras.io's VAE in small: no `call`, a `train_step` on its built encoder and decoder."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = keras.ops.cast(self.decoder(z), "float32")
            loss = keras.ops.mean(keras.ops.sum(keras.ops.square(data - reconstruction), axis=1))
            loss += keras.ops.mean(keras.ops.cast(keras.ops.sum(keras.ops.square(z_mean), axis=1), "float32"))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def test_keras_io_vae_unbuilt_with_its_sampling_layer():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    z_mean, z_log_var = keras.layers.Dense(2, name="z_mean")(h), keras.layers.Dense(2, name="z_log_var")(h)
    encoder = keras.Model(inputs, [z_mean, z_log_var, KerasIOSampling(name="sampling")([z_mean, z_log_var])],
                          name="encoder")
    latent = keras.Input((2,))
    decoder = keras.Model(latent, keras.layers.Dense(8, name="out")(keras.layers.Dense(16, activation="relu")(latent)),
                          name="decoder")
    vae = VAE(encoder, decoder)
    assert not vae.built  # never called: its encoder and decoder are built
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kmix.autocast(vae, "mixed_bfloat16") is vae
    kept = [str(w.message) for w in caught if "kept" in str(w.message)]
    assert kept and "encoder/sampling" in kept[0], [str(w.message) for w in caught]
    assert encoder.get_layer("sampling").compute_dtype == "float32"
    assert decoder.get_layer("out").compute_dtype == "bfloat16"
    data = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    with kmix.policy_scope("mixed_bfloat16"):
        vae.compile(optimizer=kmix.wrap(keras.optimizers.Adam(1e-2)))
    weights = [_numpy(v) for v in decoder.trainable_weights]
    history = vae.fit(data, epochs=2, batch_size=32, verbose=0).history["loss"]
    assert np.isfinite(history).all()
    assert all(not np.array_equal(_numpy(v), w) for v, w in zip(decoder.trainable_weights, weights))
