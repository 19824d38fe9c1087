"""`kmix.optimizers.SGD`: momentum as a sum of gradients survives float16 storage."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix


def run(optimizer, dtype, grads, start):
    w = keras.Variable(np.asarray(start, np.float32), dtype=dtype)
    for g in grads:
        optimizer.apply([tf.constant(g, dtype)], [w])
    return keras.ops.convert_to_numpy(w).astype(np.float64)


def reference(grads, lr, momentum, nesterov, start, store=np.float64):
    """torch's SGD in float64 arithmetic; `store` rounds what is kept between steps."""
    w, h = np.asarray(start, np.float64), np.zeros_like(np.asarray(start, np.float64))
    for g in grads:
        g = np.asarray(g, np.float64)
        h = (momentum * h + g).astype(store).astype(np.float64)
        step = g + momentum * h if nesterov else h
        w = (w - lr * step).astype(store).astype(np.float64)
    return w


@pytest.mark.parametrize("nesterov", [False, True])
def test_float16_storage_keeps_updates_below_the_smallest_subnormal(nesterov):
    lr, momentum, steps = 2.0**-12, 0.9, 40
    g = np.array([2.0**-14, 1.5 * 2.0**-14], np.float32)  # lr * g < 2^-25: rounds to 0 in float16
    grads, start = [g] * steps, np.zeros(2, np.float32)
    keras_w = run(keras.optimizers.SGD(lr, momentum=momentum, nesterov=nesterov), "float16", grads, start)
    kmix_w = run(kmix.optimizers.SGD(lr, momentum=momentum, nesterov=nesterov), "float16", grads, start)
    exact = reference(grads, lr, momentum, nesterov, start)
    np.testing.assert_array_equal(keras_w, start)  # lr * g is 0 in float16: nothing moves
    # The same steps with the values stored in float16 between steps, as kmix stores them...
    np.testing.assert_allclose(kmix_w, reference(grads, lr, momentum, nesterov, start, np.float16), rtol=1e-3)
    # ... which follows float64 up to float16's rounding of w (half a 2^-24 spacing a step).
    assert np.all(np.abs(kmix_w - exact) <= steps * 2.0**-25)
    assert np.all(np.abs(exact) > 3 * steps * 2.0**-25)


@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_float32_matches_keras_sgd_and_the_float64_loop(momentum, nesterov):
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(3,)).astype(np.float32) for _ in range(20)]
    start = np.ones(3, np.float32)
    ours = run(kmix.optimizers.SGD(0.05, momentum=momentum, nesterov=nesterov), "float32", grads, start)
    theirs = run(keras.optimizers.SGD(0.05, momentum=momentum, nesterov=nesterov), "float32", grads, start)
    np.testing.assert_allclose(ours, reference(grads, 0.05, momentum, nesterov, start), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_config_round_trip():
    opt = kmix.optimizers.SGD(0.1, momentum=0.8, nesterov=True, weight_decay=1e-4)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(restored) is kmix.optimizers.SGD
    assert restored.get_config() == opt.get_config()
