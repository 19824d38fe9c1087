"""`kmix.schedules.Warmup` against a float64 numpy evaluation of its formula."""

import math
import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix.schedules import Warmup
from tests.testing import assert_config_round_trip


def reference(step, base, warmup_steps, initial, shape):
    """The documented formula in float64 numpy; `base` is a function of the step."""
    b = base(step)
    if step >= warmup_steps:
        return b
    t = step / warmup_steps
    if shape == "linear":
        f = initial + (1 - initial) * t
    elif shape == "exponential":
        f = initial ** (1 - t)
    else:
        f = initial + (1 - initial) * (1 - math.cos(math.pi * t)) / 2
    return b * f


def decay_ref(step):
    """ExponentialDecay(0.2, decay_steps=7, decay_rate=0.5), by hand."""
    return 0.2 * 0.5 ** (step / 7)


BASES = {
    "float": (0.05, lambda step: 0.05),
    "schedule": (keras.optimizers.schedules.ExponentialDecay(0.2, 7, 0.5), decay_ref),
}
SHAPES = [("linear", 0.0), ("linear", 0.25), ("exponential", 0.01), ("cosine", 0.0), ("cosine", 0.1)]


@pytest.mark.parametrize("base_name", sorted(BASES))
@pytest.mark.parametrize("shape,initial", SHAPES)
def test_values_match_formula(base_name, shape, initial):
    base, base_ref = BASES[base_name]
    schedule = Warmup(base, warmup_steps=10, initial=initial, shape=shape)
    steps = np.arange(16)
    got = np.array([float(schedule(s)) for s in steps])
    want = np.array([reference(s, base_ref, 10, initial, shape) for s in steps])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    # From warmup_steps on, exactly the base (not base * f(1)).
    for s in range(10, 16):
        assert float(schedule(s)) == float(keras.ops.convert_to_numpy(
            base(s) if callable(base) else keras.ops.convert_to_tensor(base, "float32")))


def test_in_graph_under_xla_matches_formula():
    schedule = Warmup(BASES["schedule"][0], warmup_steps=6, initial=0.1, shape="cosine")
    compiled = tf.function(lambda step: schedule(step), jit_compile=True)
    got = [float(compiled(tf.constant(s, tf.int64))) for s in range(10)]
    want = [reference(s, decay_ref, 6, 0.1, "cosine") for s in range(10)]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)  # XLA's pow may differ by an ulp


def test_no_warmup_is_the_base():
    schedule = Warmup(0.3, warmup_steps=0)
    assert [float(schedule(s)) for s in range(3)] == [np.float32(0.3)] * 3


@pytest.mark.parametrize("base_name", sorted(BASES))
def test_config_round_trip(base_name):
    schedule = Warmup(BASES[base_name][0], warmup_steps=9, initial=0.05, shape="exponential")
    clone = assert_config_round_trip(schedule)
    for s in (0, 4, 9, 12):
        assert float(clone(s)) == float(schedule(s))


def test_saved_model_keeps_the_schedule():
    lr = Warmup(keras.optimizers.schedules.ExponentialDecay(0.2, 7, 0.5), 5, 0.1, "cosine")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(lr)), loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), batch_size=2, verbose=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.keras")
        model.save(path)
        loaded = keras.models.load_model(path)  # no custom_objects
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    assert int(loaded.optimizer.iterations) == 2
    assert float(loaded.optimizer.learning_rate) == float(lr(2))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(base="0.1", warmup_steps=5), "base"),
        (dict(base=-0.1, warmup_steps=5), "base"),
        (dict(base=True, warmup_steps=5), "base"),
        (dict(base=0.1, warmup_steps=2.5), "warmup_steps"),
        (dict(base=0.1, warmup_steps=-1), "warmup_steps"),
        (dict(base=0.1, warmup_steps=5, initial=1.5), "initial"),
        (dict(base=0.1, warmup_steps=5, initial="0"), "initial"),
        (dict(base=0.1, warmup_steps=5, shape="square"), "shape"),
        (dict(base=0.1, warmup_steps=5, shape="exponential"), "initial"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises((TypeError, ValueError)) as info:
        Warmup(**kwargs)
    assert f"`{name}`" in str(info.value) or f"{name}=" in str(info.value)
    assert "Received" in str(info.value)
