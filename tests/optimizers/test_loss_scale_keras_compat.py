"""Keras's own tests for `keras.optimizers.LossScaleOptimizer`, run on kmix's class.

Ported from keras/src/optimizers/loss_scale_optimizer_test.py (Keras 3.15,
TensorFlow backend, stateful cases). Three differ on purpose and say so:
`dynamic=False` is supported (Keras raises), the config carries kmix's
extra arguments (Keras's has exactly four keys), and gradients multiplied by
the scale by hand, with no `scale_loss` in the step, are passed with
`scaled=True`: kmix decides from the step what they are and takes unmarked
gradients as given (keras.io's float32 `train_step`), where Keras divides
them by the scale.
"""

import numpy as np
import pytest

import keras
from keras import ops
from keras.optimizers import SGD

from kmix import LossScaleOptimizer
from tests.testing import assert_config_round_trip


def test_is_a_keras_loss_scale_optimizer():
    opt = LossScaleOptimizer(SGD())
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    keras.config.set_dtype_policy("mixed_float16")
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt  # compile did not wrap it again


def test_config():
    inner = SGD(learning_rate=0.5, momentum=0.06, nesterov=True, weight_decay=0.004)
    assert_config_round_trip(LossScaleOptimizer(inner))


def test_apply_with_no_vars():
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5))
    grads = [ops.array([1.0, 6.0, 7.0, 2.0]) * optimizer.initial_scale]
    vars = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(vars)
    optimizer.apply(grads, scaled=True)  # differs on purpose: scaled by hand, said so
    np.testing.assert_allclose(vars[0], [0.5, -1.0, -0.5, 3.0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("inner_scale", [None, 100])
def test_finite_step(inner_scale):
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5, loss_scale_factor=inner_scale))
    grads = [ops.array([1.0, 6.0, 7.0, 2.0]) * optimizer.initial_scale]
    vars = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.apply(grads, vars, scaled=True)  # differs on purpose: scaled by hand, said so
    np.testing.assert_allclose(vars[0], [0.5, -1.0, -0.5, 3.0], rtol=1e-4, atol=1e-4)


def test_infinite_step():
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5))
    vars = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.apply([ops.array([np.inf] * 4)], vars)
    np.testing.assert_allclose(vars[0], [1.0, 2.0, 3.0, 4.0], rtol=1e-4, atol=1e-4)


def test_finite_step_with_overwrite():
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5))
    grads = [ops.array([1.0, 6.0, 7.0, 2.0])]
    vars = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    vars[0].overwrite_with_gradient = True
    optimizer.apply(grads, vars)
    np.testing.assert_allclose(vars[0], grads[0])


def test_downscaling():
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5), initial_scale=400.0)
    vars = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(vars)
    for _ in range(4):
        optimizer.apply([ops.array([np.inf] * 4)], vars)
    np.testing.assert_allclose(optimizer.scale_loss(1.0), 25.0)


def test_upscaling():
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5), initial_scale=2.0, dynamic_growth_steps=2)
    vars = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(vars)
    for _ in range(8):
        optimizer.apply([ops.array([1.0, 6.0, 7.0, 2.0])], vars)
    np.testing.assert_allclose(optimizer.scale_loss(1.0), 32.0)


def test_iterations_update():
    optimizer = LossScaleOptimizer(SGD(learning_rate=0.5))
    vars = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    optimizer.build(vars)
    assert int(optimizer.iterations.value) == 0
    for i in range(3):
        optimizer.apply([ops.array([1.0, 6.0, 7.0, 2.0])], vars)
        assert int(optimizer.iterations.value) == i + 1


def test_serialization():
    optimizer = LossScaleOptimizer(SGD(0.5), initial_scale=3.0, dynamic_growth_steps=2, name="test_opt")
    config = optimizer.get_config()
    # Differs from Keras on purpose: kmix's arguments are in the config too.
    assert config["name"] == "test_opt"
    assert config["initial_scale"] == 3.0
    assert config["growth_interval"] == 2
    assert "inner_optimizer" in config
    assert LossScaleOptimizer.from_config(config).get_config() == config


def test_init_dynamic_arg():
    LossScaleOptimizer(SGD(0.5), dynamic=True)
    # Differs from Keras on purpose: a fixed scale is supported and still skips.
    opt = LossScaleOptimizer(SGD(0.5), dynamic=False, initial_scale=8.0)
    vars = [keras.Variable([1.0])]
    for _ in range(3):
        opt.apply([ops.array([np.inf])], vars)
    assert float(opt.loss_scale) == 8.0 and int(opt.skipped_steps) == 3


def test_init_unsupported_arg():
    with pytest.raises(ValueError, match="arguments: `foo`, `bar`"):
        LossScaleOptimizer(SGD(learning_rate=0.5), foo=True, bar=3)


@pytest.mark.parametrize(
    "arg_name, arg_value",
    [
        ("weight_decay", 0.5),
        ("clipnorm", 0.5),
        ("global_clipnorm", 0.5),
        ("clipvalue", 0.5),
        ("use_ema", True),
        ("ema_momentum", 0.5),
        ("ema_overwrite_frequency", 2),
        ("loss_scale_factor", 0.5),
        ("gradient_accumulation_steps", 2),
    ],
)
def test_init_base_optimizer_unsupported_args(arg_name, arg_value):
    with pytest.raises(ValueError, match="on the `inner_optimizer`"):
        LossScaleOptimizer(SGD(learning_rate=0.5), **{arg_name: arg_value})


def test_deserialization_of_a_keras_config():
    """A config written by Keras's class (with its legacy keys) loads into kmix's."""
    inner = SGD(0.5)
    keras_config = keras.optimizers.LossScaleOptimizer(
        inner, initial_scale=2.0, dynamic_growth_steps=2
    ).get_config()
    keras_config.update(
        weight_decay=None, clipnorm=None, global_clipnorm=None, clipvalue=None, use_ema=False,
        ema_momentum=0.99, ema_overwrite_frequency=None, loss_scale_factor=None,
        gradient_accumulation_steps=None,
    )
    opt = LossScaleOptimizer.from_config(keras_config)
    assert opt.growth_interval == 2 and opt.dynamic_growth_steps == 2
    assert opt.initial_scale == 2.0
