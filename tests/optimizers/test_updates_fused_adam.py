"""kmix.wrap's fused Adam update gives Keras's Adam / AdamW trajectory, on every route."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import kmix
from kmix.optimizers import updates
from tests.optimizers.test_allreduce import two_replica_strategy  # one strategy, keys of its own
from tests.optimizers.test_loss_scale_distribution import replica_values
from tests.testing import full_only

RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, 6)).astype("float32")
Y = RNG.normal(size=(48, 1)).astype("float32")
TOKENS = RNG.integers(0, 10, size=(48, 5)).astype("int32")


def dense_model():
    """A kernel and a bias: the update is per variable, and each variable more is traced in every fit here."""
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])


def embedding_model():
    return keras.Sequential(
        [keras.Input((5,), dtype="int32"), keras.layers.Embedding(10, 4), keras.layers.Flatten(), keras.layers.Dense(1)]
    )


def trained_weights(optimizer, make_model=dense_model, x=X, jit=False, epochs=2):
    keras.utils.set_random_seed(1)
    model = make_model()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit)
    optimizer.build(model.trainable_variables)  # here, not inside fit's first trace (which traces it twice then)
    # Batched once, in order (numpy arrays would be sliced into batches again each epoch).
    model.fit(tf.data.Dataset.from_tensor_slices((x, Y)).batch(16), epochs=epochs, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def assert_same_weights(got, expected):
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


ADAMW = dict(learning_rate=1e-2, weight_decay=0.05, clipnorm=1.0, use_ema=True)


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_wrapped_fused_matches_keras(cls):
    """The fused update under tf.function and under XLA, against one run of Keras's own update, unwrapped."""
    make = getattr(keras.optimizers, cls)
    kwargs = ADAMW if cls == "AdamW" else {"learning_rate": keras.optimizers.schedules.ExponentialDecay(1e-2, 3, 0.5)}
    expected = trained_weights(make(**kwargs))
    for jit in (False, True):
        wrapped = kmix.wrap(make(**kwargs))
        assert updates.fused(wrapped.inner_optimizer)
        assert_same_weights(trained_weights(wrapped, jit=jit), expected)


def test_fused_update_equals_float64_adam():
    """Six steps of Adam on one float32 variable against the textbook update in float64."""
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-7
    opt = keras.optimizers.Adam(lr, beta_1=b1, beta_2=b2, epsilon=eps)
    assert updates.use_fused_adam(opt)
    w = keras.Variable(np.linspace(-1, 1, 5), dtype="float32")
    opt.build([w])
    grads = RNG.normal(size=(6, 5))
    ref, m, v = np.linspace(-1, 1, 5).astype(np.float64), np.zeros(5), np.zeros(5)
    for t, g in enumerate(grads, start=1):
        opt.apply([tf.constant(g, tf.float32)], [w])
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        ref = ref - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
    np.testing.assert_allclose(w.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_sparse_embedding_gradients_keep_keras_update():
    wrapped = kmix.wrap(keras.optimizers.Adam(1e-2))
    expected = trained_weights(keras.optimizers.Adam(1e-2), embedding_model, TOKENS)
    assert_same_weights(trained_weights(wrapped, embedding_model, TOKENS), expected)


@pytest.mark.filterwarnings("ignore:Layers built inside kmix.policy_scope")
def test_bfloat16_parameters_with_float32_masters_are_fused():
    """O2: bfloat16 variables, float32 masters; the inner Adam updates the masters."""
    with kmix.policy_scope("O2-bfloat16"):
        fused = trained_weights(kmix.wrap(keras.optimizers.Adam(1e-2)))
        plain = trained_weights(kmix.wrap(keras.optimizers.Adam(1e-2), fused_update=False))
    assert str(fused[0].dtype) == "bfloat16"
    for f, p in zip(fused, plain):
        np.testing.assert_allclose(f.astype(np.float32), p.astype(np.float32), rtol=1e-2, atol=1e-2)
        assert f.dtype == p.dtype


def test_kahan_bfloat16_variables_keep_keras_update():
    keras.config.set_dtype_policy("bfloat16")
    make = lambda fused: kmix.wrap(keras.optimizers.Adam(1e-2, beta_2=0.99), master_weights="kahan",
                                   fused_update=fused)
    assert_same_weights(trained_weights(make(True)), trained_weights(make(False)))


def test_two_replicas_match_keras_update_under_the_strategy():
    strategy = two_replica_strategy()

    def train(fused):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = dense_model()
            model.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(**ADAMW), fused_update=fused), loss="mse")
        model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        assert updates.fused(model.optimizer.inner_optimizer) == fused
        return [replica_values(w) for w in model.weights]

    for fused_copies, keras_copies in zip(train(True), train(False)):
        assert len(fused_copies) == 2
        for copy in fused_copies:  # every replica's copy updated, and alike
            np.testing.assert_allclose(copy, keras_copies[0], rtol=1e-5, atol=1e-6)


def test_which_optimizers_are_fused():
    class MyAdam(keras.optimizers.Adam):
        pass

    assert updates.can_fuse(keras.optimizers.AdamW())
    assert not updates.can_fuse(keras.optimizers.Adam(amsgrad=True))
    assert not updates.can_fuse(MyAdam())  # a subclass may change the update
    assert not updates.can_fuse(keras.optimizers.SGD())
    sgd = kmix.wrap(keras.optimizers.SGD(0.1))
    assert not updates.fused(sgd.inner_optimizer)


def test_fused_update_false_restores_keras_update_and_round_trips():
    inner = keras.optimizers.Adam(1e-3)
    assert updates.fused(kmix.wrap(inner).inner_optimizer)
    unfused = kmix.LossScaleOptimizer(inner, fused_update=False)
    assert not updates.fused(inner)
    config = unfused.get_config()
    assert config["fused_update"] is False
    again = kmix.LossScaleOptimizer.from_config(config)
    assert again.fused_update is False and not updates.fused(again.inner_optimizer)
    assert kmix.LossScaleOptimizer.from_config(kmix.wrap("adam").get_config()).fused_update is True
    with pytest.raises(TypeError, match=r"Received: fused_update='yes'"):
        kmix.LossScaleOptimizer(keras.optimizers.Adam(), fused_update="yes")


def test_fused_model_saves_and_reloads(tmp_path):
    keras.utils.set_random_seed(1)
    model = dense_model()
    model.compile(optimizer=kmix.wrap(keras.optimizers.AdamW(1e-2)), loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert updates.fused(loaded.optimizer.inner_optimizer)
    # Both continue identically from the restored slots.
    model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    loaded.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_same_weights([w.numpy() for w in loaded.weights], [w.numpy() for w in model.weights])


@pytest.mark.parametrize("name, level", [
    ("mean_pool", "float32"), ("mean_pool", "O1-bfloat16"),
    pytest.param("bert", "O1-bfloat16", marks=full_only("21 s on 2 cores; the keras.ops graph runs by default")),
    pytest.param("bert", "float32", marks=full_only("35 s on 2 cores; the keras.ops graph runs by default")),
])
def test_fused_update_on_real_models_follows_keras_update(name, level):
    """keras-hub's BERT (with a pooling slice) and a keras.ops graph, trained with both updates."""
    pytest.importorskip("keras_hub")
    from tests.placing.test_real_models import MODELS

    runs = {}
    for fused in (True, False):
        keras.utils.set_random_seed(0)
        model, x, y = MODELS[name](np.random.default_rng(0))
        placed = kmix.autocast(model, level) if level != "float32" else model
        with kmix.policy_scope(level):
            optimizer = kmix.wrap(keras.optimizers.AdamW(3e-3), fused_update=fused)
            placed.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        optimizer.build(placed.trainable_variables)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
        history = placed.fit(data, epochs=3, shuffle=False, verbose=0).history["loss"]
        assert updates.fused(optimizer.inner_optimizer) == fused
        runs[fused] = history, [w.numpy() for w in placed.trainable_weights]
    (loss_fused, fused_weights), (loss_keras, keras_weights) = runs[True], runs[False]
    if level == "float32":
        np.testing.assert_allclose(loss_fused, loss_keras, rtol=1e-5)
        for f, k in zip(fused_weights, keras_weights):
            np.testing.assert_allclose(f, k, rtol=1e-5, atol=1e-5)
        return
    # Under bfloat16 only the epoch losses are compared, and loosely after the first: a parameter
    # whose true gradient is 0 (BERT's key bias: the softmax ignores a shift of a whole row) gets
    # bfloat16 rounding noise as its gradient, which Adam normalizes into steps of up to lr
    # whatever kernel applies them, and the float32 rounding of the two kernels (1e-7) moves
    # bfloat16 activations across rounding boundaries differently on each CPU: measured 1.6e-3
    # apart by the third epoch of BERT on an AVX512_BF16 CPU.
    np.testing.assert_allclose(loss_fused[0], loss_keras[0], rtol=1e-3)
    np.testing.assert_allclose(loss_fused, loss_keras, rtol=1e-2)
