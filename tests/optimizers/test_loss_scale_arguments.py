"""Bad constructor arguments fail at the call, naming the argument and what is accepted."""

import pytest

import keras
import kmix

BAD = [
    (dict(growth_factor=1.0), ValueError, "growth_factor.*> 1"),
    (dict(growth_factor=0.5), ValueError, "growth_factor"),
    (dict(backoff_factor=1.0), ValueError, r"backoff_factor.*\(0, 1\)"),
    (dict(backoff_factor=0.0), ValueError, "backoff_factor"),
    (dict(min_scale=4.0, max_scale=2.0, initial_scale=3.0), ValueError, "min_scale.*max_scale"),
    (dict(initial_scale=0.0), ValueError, "initial_scale.*> 0"),
    (dict(initial_scale=-2.0), ValueError, "initial_scale"),
    (dict(initial_scale=float("nan")), ValueError, "initial_scale.*finite"),
    (dict(initial_scale="big"), TypeError, "initial_scale.*real number"),
    (dict(growth_interval=0), ValueError, "growth_interval.*int >= 1"),
    (dict(growth_interval=2.5), TypeError, "growth_interval"),
    (dict(hysteresis=0), ValueError, "hysteresis.*int >= 1"),
    (dict(initial_scale=2.0**30), ValueError, r"initial_scale.*\[min_scale, max_scale\]"),
    (dict(dynamic="yes"), TypeError, "dynamic"),
    (dict(master_weights="sometimes"), ValueError, "master_weights"),
    (dict(growth_interval=10, dynamic_growth_steps=20), ValueError, "dynamic_growth_steps"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_argument(kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        kmix.LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)
    assert "Received" in str(info.value)


@pytest.mark.parametrize("inner", [None, "adam", object()])
def test_inner_must_be_a_keras_optimizer(inner):
    with pytest.raises(TypeError, match="inner_optimizer.*keras.optimizers.Optimizer"):
        kmix.LossScaleOptimizer(inner)


def test_no_loss_scale_optimizer_inside_another():
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        kmix.LossScaleOptimizer(kmix.wrap("sgd"))


def test_growth_interval_alias():
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(), dynamic_growth_steps=7)
    assert opt.growth_interval == opt.dynamic_growth_steps == 7
