"""`kmix.wrap` follows the model it trains: float16 compute gets dynamic scaling wherever compiled."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix import _state


def half_model():
    """float16 layers under the float32 global policy (not made by autocast)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="relu", dtype="mixed_float16"),
        keras.layers.Dense(1, dtype="float32"),
    ])


def fit(model, opt):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, 0.1 * x.sum(axis=1, keepdims=True), batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def test_float16_layers_compiled_outside_any_policy_get_dynamic_scaling(caplog):
    opt = kmix.wrap(keras.optimizers.SGD(0.1))  # float32 global policy: fixed scale 1 for now
    assert not opt.dynamic and opt.initial_scale == 1.0
    with caplog.at_level(logging.INFO, logger="kmix"):
        got = fit(half_model(), opt)
    assert opt.dynamic and float(opt.loss_scale) == 2.0**15
    assert "switched to dynamic loss scaling from 32768" in caplog.text
    # The reference: the same model compiled with an optimizer wrapped under a float16 policy.
    with kmix.policy_scope("mixed_float16"):
        reference_opt = kmix.wrap(keras.optimizers.SGD(0.1))
    reference = fit(half_model(), reference_opt)
    for a, b in zip(reference, got):
        np.testing.assert_array_equal(b, a)
    # The config keeps what wrap decided ("auto"), so a copy made from it trains the same.
    assert opt.get_config()["dynamic"] == "auto"
    copy = kmix.LossScaleOptimizer.from_config(opt.get_config())
    assert not copy.dynamic
    for a, b in zip(got, fit(half_model(), copy)):
        np.testing.assert_array_equal(b, a)
    assert copy.dynamic and float(copy.loss_scale) == 2.0**15


def test_an_explicit_fixed_scale_is_kept_with_a_warning():
    opt = kmix.wrap(keras.optimizers.SGD(0.1), dynamic=False)
    with pytest.warns(UserWarning, match=r"fixed loss scale of 1.*kmix.wrap\(opt, dynamic=True"):
        fit(half_model(), opt)
    assert not opt.dynamic and float(opt.loss_scale) == 1.0


def test_float32_model_keeps_the_fixed_scale():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = kmix.wrap(keras.optimizers.SGD(0.1))
    fit(model, opt)
    assert not opt.dynamic and float(opt.loss_scale) == 1.0


def test_recorded_compute_dtype_and_advised_scale_reach_a_custom_loop_build():
    """What autocast records on the variables is enough: no model needed at build."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    for v in model.trainable_variables:
        setattr(v, _state.ATTRIBUTE, _state.Placed("float16", "O1-float16", 2.0**10))
    opt = kmix.wrap(keras.optimizers.SGD(0.1))
    opt.build(model.trainable_variables)
    assert opt.dynamic and float(opt.loss_scale) == 2.0**10


@pytest.mark.parametrize("kwargs, start", [
    ({"dynamic": True}, 2.0**15),  # dynamic alone: where a dynamic scale starts, not at wrap's fixed 1
    ({"hysteresis": 2}, 2.0**15),  # an argument about something else: the policy's choices still follow
    ({"initial_scale": 2.0**10}, 2.0**10),  # the caller's scale, made dynamic by the float16 model
])
def test_explicit_arguments_outside_a_scope_still_follow_a_float16_model(kwargs, start):
    opt = kmix.wrap(keras.optimizers.SGD(0.1), growth_interval=2, **kwargs)
    assert float(opt.loss_scale) == (start if kwargs.get("dynamic") else kwargs.get("initial_scale", 1.0))
    got = fit(half_model(), opt)
    assert opt.dynamic and opt.initial_scale == start
    # The reference: wrapped under a float16 policy, with the same arguments and start.
    with kmix.policy_scope("mixed_float16"):
        reference_opt = kmix.wrap(keras.optimizers.SGD(0.1), growth_interval=2, **{**kwargs, "initial_scale": start})
    reference = fit(half_model(), reference_opt)
    assert float(opt.loss_scale) == float(reference_opt.loss_scale) == start * 2.0**2  # 4 steps: grew twice
    for a, b in zip(reference, got):
        np.testing.assert_array_equal(b, a)


def test_the_advised_scale_is_where_a_built_optimizer_starts():
    """What kmix.autocast(model, level, sample=) records: the optimizer starts there, unless told otherwise."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    for v in model.trainable_variables:
        setattr(v, _state.ATTRIBUTE, _state.Placed("float16", "O1-float16", 64.0))
    with kmix.policy_scope("O1"):
        advised = kmix.wrap(keras.optimizers.SGD(0.1))
        chosen = kmix.wrap(keras.optimizers.SGD(0.1), initial_scale=2.0**10)
    assert float(advised.loss_scale) == 2.0**15 and float(chosen.loss_scale) == 2.0**10  # before build
    advised.build(model.trainable_variables)
    chosen.build(model.trainable_variables)
    assert float(advised.loss_scale) == 64.0 and float(chosen.loss_scale) == 2.0**10
    assert float(advised.scale_loss(tf.constant(1.0))) == 64.0
