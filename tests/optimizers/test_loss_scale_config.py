"""`LossScaleOptimizer.from_config(opt.get_config())` trains exactly as `opt`, for every way `kmix.wrap` makes one.

Both train eagerly (`run_eagerly=True`): what is compared is the values, and no step is traced (two traces a
case otherwise); the config has nothing that acts only in a traced step here (no batch statistics to put back).
"""

import warnings

import keras
import numpy as np
import pytest

import kmix

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 6)).astype("float32")
Y = (X @ RNG.normal(size=(6, 1))).astype("float32")
X[8] = 3e4  # one batch whose float16 gradients overflow: a skipped step and a back-off under a dynamic scale


def model_at(level):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    return kmix.autocast(model, level)


WAYS = {
    "in_scope": lambda level: _in_scope(level),
    "outside": lambda level: kmix.wrap(keras.optimizers.Adam(1e-2), growth_interval=2),
    "outside_dynamic": lambda level: kmix.wrap(keras.optimizers.Adam(1e-2), dynamic=True, growth_interval=2),
    "outside_scale": lambda level: kmix.wrap(keras.optimizers.Adam(1e-2), initial_scale=2.0**10, growth_interval=2),
    "keras_rewrapped": lambda level: kmix.wrap(keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), initial_scale=2.0**12, dynamic_growth_steps=2)),
}


def _in_scope(level):
    with kmix.policy_scope(level):
        return kmix.wrap(keras.optimizers.Adam(1e-2), growth_interval=2)


def train(level, optimizer):
    model = model_at(level)
    model.compile(optimizer=optimizer, loss="mse", run_eagerly=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "LossScaleOptimizer .* skipped a step run eagerly")
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


CASES = [(level, way) for level in ("O1", "O1-bfloat16") for way in sorted(WAYS)] + [("O2", "outside")]


@pytest.mark.parametrize("level,way", CASES)
def test_from_config_trains_as_the_original(level, way):
    original = WAYS[way](level)
    copy = kmix.LossScaleOptimizer.from_config(original.get_config())  # before either is built
    a, b = train(level, original), train(level, copy)
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_array_equal(y, x)
    for name in ("loss_scale", "skipped_steps", "iterations", "good_steps"):
        assert float(getattr(copy, name)) == float(getattr(original, name)), name
    assert (copy.dynamic, copy.initial_scale, copy.master_weights) == (
        original.dynamic, original.initial_scale, original.master_weights)
    if level != "O1-bfloat16":  # float16 compute: every way ends with dynamic loss scaling
        assert original.dynamic and int(original.skipped_steps) >= 1
    # A copy made after training (the config a .keras file holds) is the same optimizer too.
    assert kmix.LossScaleOptimizer.from_config(original.get_config()).get_config() == original.get_config()
