"""Twenty non-finite batches in a row (NaN and inf inputs, batch norm inside) leave no trace.

The reference is the same training without the bad batches, at the scale the
storm leaves (the floor, 1): after it, every weight, batch-norm statistic and
Adam slot equals the reference bit for bit, the scale sits at `min_scale`,
and the counters say what happened. Plain Keras, for contrast, takes the
storm into its batch-norm statistics.
"""

import keras
import numpy as np

import kmix

STORM, GOOD = 20, 3


def _batches(storm):
    rng = np.random.default_rng(3)
    good = []
    for _ in range(GOOD):
        x = rng.normal(size=(8, 4)).astype("float32")
        good.append((x, x.sum(axis=1, keepdims=True)))
    bad = []
    for i in range(STORM if storm else 0):
        x = rng.normal(size=(8, 4)).astype("float32")
        x[i % 8, i % 4] = np.nan if i % 2 else np.inf
        bad.append((x, x[:, :1]))
    return bad + good


def _build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(1, dtype="float32"),
    ])


def _train(optimizer, storm):
    keras.config.set_dtype_policy("mixed_float16")
    model = _build()
    model.compile(optimizer=optimizer, loss="mse")
    data = _batches(storm)
    x, y = np.concatenate([b[0] for b in data]), np.concatenate([b[1] for b in data])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    slots = [keras.ops.convert_to_numpy(v) for v in model.optimizer.inner_optimizer.variables]
    return model, [np.asarray(w) for w in model.get_weights()], slots


def test_twenty_overflows_in_a_row_change_no_weight_statistic_or_slot():
    model, state, slots = _train(kmix.wrap(keras.optimizers.Adam(1e-2)), storm=True)  # dynamic, from 2^15
    opt = model.optimizer
    _, ref_state, ref_slots = _train(kmix.wrap(keras.optimizers.Adam(1e-2), dynamic=False, initial_scale=1.0),
                                     storm=False)
    assert int(opt.skipped_steps) == STORM and int(opt.iterations) == GOOD
    assert float(opt.loss_scale) == opt.min_scale == 1.0  # halved 15 times, then held at the floor
    assert int(opt.min_scale_overflows) == STORM - 15
    assert len(state) == 8  # 2 kernels, 2 biases, gamma, beta, moving mean and variance
    for got, expected in zip(state + slots, ref_state + ref_slots):
        np.testing.assert_array_equal(got, expected)


def test_plain_keras_takes_the_storm_into_its_batch_norm_statistics():
    """The contrast that makes the test above meaningful: the bad batches do reach the statistics."""
    keras.config.set_dtype_policy("mixed_float16")
    model = _build()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")  # Keras's own loss scaling
    data = _batches(storm=True)
    x, y = np.concatenate([b[0] for b in data]), np.concatenate([b[1] for b in data])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert not np.isfinite(model.layers[1].moving_mean.numpy()).all()
