"""Under `tf.distribute.MirroredStrategy`, an overflow on any replica skips the step everywhere."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import kmix


def two_replica_strategy():
    cpus = tf.config.list_logical_devices("CPU")
    if len(cpus) < 2:
        pytest.skip("needs the two logical CPU devices that tests/conftest.py configures")
    return tf.distribute.MirroredStrategy([d.name for d in cpus[:2]])


def build(strategy, make_optimizer):
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1, dtype="float32")]
        )
        model.compile(optimizer=make_optimizer(), loss="mse")
    return model


def replica_values(variable):
    """The per-device copies of a mirrored variable, as NumPy arrays."""
    v = getattr(variable, "value", variable)
    return [np.asarray(c.numpy()) for c in v.values]


def test_overflow_on_one_replica_skips_on_all():
    """An inf on replica 0 in the first batch, on replica 1 in the second: each step skipped on both."""
    strategy = two_replica_strategy()
    model = build(strategy, lambda: kmix.wrap(keras.optimizers.SGD(0.1)))
    initial = model.get_weights()
    x = np.ones((8, 4), np.float32)
    x[0, 0] = np.inf  # each global batch of 4 is split 2 + 2: row 0 is replica 0's...
    x[4 + 3, 0] = np.inf  # ...and the second batch's row 3 replica 1's
    y = np.ones((8, 1), np.float32)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    opt = model.optimizer
    assert int(opt.skipped_steps.numpy()) == 2
    assert float(opt.loss_scale) == 2.0**13  # backed off once each
    assert int(opt.iterations.numpy()) == 0
    for w, w0 in zip(model.trainable_weights, initial):
        copies = replica_values(w)
        assert len(copies) == 2
        for c in copies:
            np.testing.assert_array_equal(c, w0)
    for v in (opt.dynamic_scale, opt.skipped_steps, opt.overflow_counts):
        a, b = replica_values(v)
        np.testing.assert_array_equal(a, b)

    # A finite batch afterwards trains, identically on both replicas.
    model.fit(np.ones((4, 4), np.float32), y[:4], batch_size=4, epochs=1, verbose=0)
    assert int(opt.iterations.numpy()) == 1
    for w, w0 in zip(model.trainable_weights, initial):
        a, b = replica_values(w)
        np.testing.assert_array_equal(a, b)
        assert np.isfinite(a).all() and not np.array_equal(a, w0)


def test_matches_single_device_training():
    """Two replicas over a global batch give the single-device weights (to rounding)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    x[9, 1] = np.inf
    results = []
    for strategy in (tf.distribute.get_strategy(), two_replica_strategy()):
        model = build(strategy, lambda: kmix.wrap(keras.optimizers.Adam(1e-2)))
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        results.append((model.get_weights(), int(model.optimizer.skipped_steps.numpy())))
    assert results[0][1] == results[1][1] == 1
    for a, b in zip(results[0][0], results[1][0]):
        np.testing.assert_allclose(b, a, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("feature", ["accumulation", "master_weights"])
def test_features_under_two_replicas_match_one_device(feature):
    """Accumulation and float32 master weights give the single-device result under MirroredStrategy."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    x[20, 2] = np.nan  # one overflowing (micro-)batch
    results = []
    for strategy in (tf.distribute.get_strategy(), two_replica_strategy()):
        if feature == "accumulation":
            model = build(strategy, lambda: kmix.wrap(keras.optimizers.SGD(0.05), accumulation_steps=2))
        else:
            keras.config.set_dtype_policy("float16")
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
                model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(0.05), master_weights=True), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        opt = model.optimizer
        results.append((model.get_weights(), int(opt.skipped_steps.numpy()), int(opt.iterations.numpy())))
        if strategy.num_replicas_in_sync == 2:
            for w in model.trainable_weights:
                a, b = replica_values(w)
                np.testing.assert_array_equal(a, b)
    expected_steps = (1, 1) if feature == "accumulation" else (1, 3)
    assert results[0][1:] == results[1][1:] == expected_steps
    for a, b in zip(results[0][0], results[1][0]):
        np.testing.assert_allclose(np.float32(b), np.float32(a), rtol=5e-3, atol=5e-3)
