"""keras.io's transfer-learning recipe after `kmix.autocast`: freeze, place, fit, unfreeze, recompile, fit.

A layer frozen when `autocast` runs must train once unfrozen, at every opt level (at O2 / O3
its variables get half storage then). The reference: the same recipe in float32, whose
unfrozen kernel moves by the same amount within the half dtype's rounding.
"""

import keras
import numpy as np
import pytest

import kmix


def _recipe(level):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    base = keras.layers.Dense(16, name="base")
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(base(inputs)))
    base.trainable = False
    if level is not None:
        kmix.autocast(model, level)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    with kmix.policy_scope(level or "float32"):
        model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(0.05)), loss="mse")
    model.optimizer.build(model.trainable_variables)  # built before fit: one trace of the train step, not two
    model.fit(x, y, batch_size=64, verbose=0)
    base.trainable = True
    with kmix.policy_scope(level or "float32"):
        model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(0.05)), loss="mse")
    model.optimizer.build(model.trainable_variables)
    before = np.asarray(base.kernel.numpy(), np.float32)
    model.fit(x, y, batch_size=64, verbose=0)
    return np.asarray(base.kernel.numpy(), np.float32) - before


@pytest.fixture(scope="module")
def reference():
    """The float32 recipe's move of the unfrozen kernel: run once, the same for every level."""
    return _recipe(None)


@pytest.mark.parametrize("level", ["O1", "O2", "O2-bfloat16", "O3"])
def test_a_layer_frozen_at_placement_trains_once_unfrozen(reference, level):
    moved = _recipe(level)
    assert np.abs(reference).max() > 1e-3
    # One SGD step: the update is lr * gradient, computed in half: a few percent of it.
    np.testing.assert_allclose(moved, reference, atol=0.1 * np.abs(reference).max())
