"""Each opt level trains a small model to within tolerance of the float32 run.

The reference is the same model, from the same initial weights, on the same
batches, trained in float32 (O0). Each level is reached the way a user would:
`kmix.autocast(model, level)` inside `kmix.policy_scope(level)`, compiled with
`kmix.wrap(optimizer)` and `master_weights="auto"`.
"""

import keras
import numpy as np
import pytest

import kmix
from kmix import autocast
from kmix.policy import Policy, policy_scope

EPOCHS = 10


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    w = rng.normal(size=(8,)).astype("float32")
    y = (np.sin(x @ w) + 0.1 * x[:, 0] ** 2)[:, None].astype("float32")
    return x, y


def build(weights=None):
    inputs = keras.Input((8,))
    h = keras.layers.Dense(32, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(1))(inputs)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Dense(32, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(2))(h)
    model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3))(h))
    if weights is not None:
        model.set_weights(weights)
    return model


def optimizer():
    # epsilon 1e-3 and beta_2 0.99: with the defaults (1e-7, 0.999) Adam's own state is not
    # representable in pure half precision (0.999 rounds to 1.0 in bfloat16), which is O3's point.
    return keras.optimizers.Adam(3e-3, beta_2=0.99, epsilon=1e-3)


def train(level, half=None):
    x, y = data()
    base = build()
    with policy_scope(level, half=half) as policy:
        model = base if level == "O0" else autocast(base, policy)
        opt = kmix.wrap(optimizer())
        model.compile(optimizer=opt, loss="mse")
        opt.build(model.trainable_variables)  # built before fit: one trace of the train step, not two
        history = model.fit(x, y, batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0)
    # Called once eagerly: a readout needs no `predict` trace.
    pred = keras.ops.convert_to_numpy(model(x, training=False)).astype(np.float64)
    return history.history["loss"], pred, opt, model


@pytest.fixture(scope="module")
def float32_run():
    losses, pred, _, _ = train("O0")
    return losses, pred


LEVELS = [
    # level, half, tolerance on the predictions' RMS difference from float32
    ("O1", "float16", 0.04),
    ("O2", "float16", 0.04),
    ("O3", "float16", 0.04),
    ("O1", "bfloat16", 0.06),
    ("O2", "bfloat16", 0.06),
    ("O3", "bfloat16", 0.1),
]


@pytest.mark.parametrize("level, half, tol", LEVELS, ids=[f"{lv}-{h}" for lv, h, _ in LEVELS])
def test_trains_like_float32(float32_run, level, half, tol):
    ref_losses, ref_pred = float32_run
    assert ref_losses[-1] < 0.5 * ref_losses[0]  # the float32 run learns something
    losses, pred, opt, model = train(level, half)
    policy = Policy(level, half=half)
    masters = [v for v in opt.variables if v.name.startswith("master_")]
    assert bool(masters) == (level == "O2")  # float32 copies only where params are half and asked for
    assert opt.dynamic == policy.needs_loss_scaling
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses[-1], ref_losses[-1], rtol=0.05)
    rms = float(np.sqrt(np.mean((pred - ref_pred) ** 2)))
    assert rms < tol, (level, half, rms)
    kernels = {w.dtype for w in model.trainable_weights}
    assert policy.params_dtype in kernels
