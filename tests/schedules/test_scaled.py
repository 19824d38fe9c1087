"""`kmix.schedules.Scaled`: factor * schedule, against the schedule evaluated directly."""

import keras
import numpy as np
import pytest

from kmix.schedules import Scaled, Warmup
from tests.testing import assert_config_round_trip


def test_values_and_composed_factors():
    decay = keras.optimizers.schedules.ExponentialDecay(0.2, 7, 0.5)
    half = Scaled(decay, 0.5)
    for s in range(12):
        np.testing.assert_allclose(float(half(s)), 0.5 * 0.2 * 0.5 ** (s / 7), rtol=1e-6)
    quarter = Scaled.scale(half, 0.5)
    assert quarter.schedule is decay and quarter.factor == 0.25  # multiplied, not nested
    assert float(quarter(3)) == float(decay(3)) * 0.25


def test_config_round_trip_with_nested_schedules():
    schedule = Scaled(Warmup(keras.optimizers.schedules.CosineDecay(0.1, 50), 10, 0.1), 0.125)
    clone = assert_config_round_trip(schedule)
    assert [float(clone(s)) for s in (0, 5, 20)] == [float(schedule(s)) for s in (0, 5, 20)]


@pytest.mark.parametrize(
    "args,name",
    [((0.1, 0.5), "schedule"), ((Warmup(0.1, 3), 0.0), "factor"), ((Warmup(0.1, 3), "2"), "factor")],
)
def test_bad_arguments_are_named(args, name):
    with pytest.raises((TypeError, ValueError), match=f"`{name}`"):
        Scaled(*args)
