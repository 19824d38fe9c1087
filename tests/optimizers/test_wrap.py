"""`kmix.wrap`: accepted inputs, policy defaults, re-wrapping."""

import numpy as np
import pytest

import keras
import kmix


@pytest.mark.parametrize(
    "given", [keras.optimizers.Adam(1e-3), "adam", {"class_name": "Adam", "config": {"learning_rate": 1e-3}}]
)
def test_accepts_instance_name_or_config(given):
    opt = kmix.wrap(given)
    assert isinstance(opt, kmix.LossScaleOptimizer)
    assert isinstance(opt.inner_optimizer, keras.optimizers.Adam)


@pytest.mark.parametrize(
    "policy, dynamic, scale",
    [("mixed_float16", True, 2.0**15), ("float16", True, 2.0**15),
     ("mixed_bfloat16", False, 1.0), ("float32", False, 1.0)],
)
def test_defaults_follow_the_policy(policy, dynamic, scale):
    keras.config.set_dtype_policy(policy)
    opt = kmix.wrap("sgd")
    assert opt.dynamic is dynamic
    assert opt.initial_scale == scale


def test_keyword_arguments_override_the_policy():
    keras.config.set_dtype_policy("mixed_bfloat16")
    opt = kmix.wrap("sgd", dynamic=True, initial_scale=2.0**8, hysteresis=2)
    assert (opt.dynamic, opt.initial_scale, opt.hysteresis) == (True, 256.0, 2)


def test_kmix_optimizer_returned_unchanged():
    opt = kmix.wrap("sgd", hysteresis=2)
    assert kmix.wrap(opt) is opt
    assert kmix.wrap(opt, hysteresis=2) is opt
    with pytest.raises(ValueError, match="hysteresis=3 .has 2"):
        kmix.wrap(opt, hysteresis=3)


def test_keras_loss_scale_optimizer_rewrapped_with_its_scale():
    inner = keras.optimizers.SGD(0.1)
    keras_opt = keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**10, dynamic_growth_steps=50)
    var = keras.Variable(np.ones(2, np.float32))
    keras_opt.build([var])
    keras_opt.apply([keras.ops.array([np.inf, 1.0])], [var])  # scale -> 512
    opt = kmix.wrap(keras_opt)
    assert type(opt) is kmix.LossScaleOptimizer
    assert opt.inner_optimizer is inner
    assert opt.initial_scale == 512.0 and opt.growth_interval == 50


@pytest.mark.parametrize("bad", [42, None, keras.layers.Dense(2)])
def test_rejects_non_optimizers(bad):
    with pytest.raises(TypeError, match="optimizer.*keras.optimizers.Optimizer.*Received"):
        kmix.wrap(bad)


def test_rejects_unknown_name():
    with pytest.raises(ValueError, match="optimizer='adamm'"):
        kmix.wrap("adamm")
