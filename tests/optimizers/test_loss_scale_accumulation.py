"""Gradient accumulation: k micro-batches equal one big batch; one overflow discards the step."""

import numpy as np
import pytest

import keras
import kmix


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])


def data(n=96):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, (x @ rng.normal(size=(5, 1))).astype("float32")


INNER = {"SGD": lambda: keras.optimizers.SGD(0.1, momentum=0.5), "Adam": lambda: keras.optimizers.Adam(1e-2)}


@pytest.mark.parametrize("inner", INNER)
def test_four_micro_batches_of_8_equal_one_batch_of_32(inner):
    x, y = data()
    big = make_model()
    big.compile(optimizer=kmix.wrap(INNER[inner]()), loss="mse")
    big.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    small = make_model()
    opt = kmix.wrap(INNER[inner](), accumulation_steps=4)
    small.compile(optimizer=opt, loss="mse")
    small.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations) == 3 == int(big.optimizer.iterations)
    for a, b in zip(big.get_weights(), small.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)


def test_overflow_in_micro_batch_3_discards_the_whole_step():
    x, y = data(32)
    x[2 * 8 + 1, 0] = np.inf  # micro-batch 3 of 4
    model = make_model()
    opt = kmix.wrap(keras.optimizers.Adam(1e-2), accumulation_steps=4, dynamic=True, initial_scale=2.0**10)
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    before = [w.copy() for w in model.get_weights()]
    slots = [v.numpy().copy() for v in opt.inner_optimizer.variables]
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, v in zip(slots, opt.inner_optimizer.variables):
        np.testing.assert_array_equal(a, v.numpy())
    assert int(opt.skipped_steps) == 1
    assert float(opt.loss_scale) == 2.0**9  # backed off once, not once per micro-batch
    assert int(opt.iterations) == 0
    assert int(opt._micro_step) == 0 and not np.any(opt._accumulators[0].numpy())


@pytest.mark.parametrize("jit", [False, True])
def test_remainder_applied_with_its_own_divisor(jit):
    """40 rows in micro-batches of 8 with k=4: one full step of 32, then a flush of 8."""
    x, y = data(40)
    model = make_model()
    opt = kmix.wrap(keras.optimizers.SGD(0.1), accumulation_steps=4)
    model.compile(optimizer=opt, loss="mse", jit_compile=jit)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(opt.iterations) == 2  # fit's finalize_variable_values flushed the remainder
    reference = make_model()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.train_on_batch(x[:32], y[:32])
    reference.train_on_batch(x[32:], y[32:])
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)


def test_inner_gradient_accumulation_is_refused():
    with pytest.raises(ValueError, match="accumulation_steps=3"):
        kmix.wrap(keras.optimizers.SGD(gradient_accumulation_steps=3))
