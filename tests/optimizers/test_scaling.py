"""`scale_rule.ScaleRule.adjust` alone equals the plain-Python pseudo-code run step for step."""

import numpy as np
import pytest
import tensorflow as tf

from kmix.optimizers.scaling import ScaleRule, ScaleState
from tests.optimizers.test_scaling_trajectory import SETTINGS, simulate


def run_rule(overflows, initial_scale, growth_interval, growth_factor, backoff_factor,
             hysteresis, min_scale, max_scale, dynamic=True):
    """`adjust` over every step, in one graph (`tf.scan`); returns (scale, good_steps) per step."""
    rule = ScaleRule(growth_interval, growth_factor, backoff_factor, hysteresis, min_scale, max_scale, dynamic)
    initial = ScaleState(tf.constant(initial_scale, tf.float32), tf.constant(0, tf.int64),
                         tf.constant(hysteresis, tf.int64))

    @tf.function
    def scan(finite):
        return tf.scan(lambda state, f: tuple(rule.adjust(ScaleState(*state), f)), finite, initializer=tuple(initial))

    scales, good, _ = scan(tf.constant(~overflows))
    return list(zip(scales.numpy().tolist(), good.numpy().tolist()))


@pytest.mark.parametrize("settings", SETTINGS, ids=["torch", "megatron", "bounds", "fixed"])
def test_rule_matches_simulation(settings):
    rng = np.random.default_rng(7)
    overflows = rng.random(3000) < 0.08
    overflows[1000:1012] = True  # a burst that walks the scale down to its floor
    got = run_rule(overflows, **settings)
    expected = [(scale, good) for scale, good, _ in simulate(overflows, **settings)]
    assert got == expected


def test_rule_is_pure_and_takes_a_variable_interval():
    rule = ScaleRule(tf.Variable(3, dtype=tf.int64), 2.0, 0.5, 1, 1.0, 8.0)
    state = ScaleState(tf.constant(4.0), tf.constant(2, tf.int64), tf.constant(1, tf.int64))
    grown = rule.adjust(state, True)
    assert (float(grown.scale), int(grown.good_steps), int(grown.hysteresis_left)) == (8.0, 0, 1)
    assert float(state.scale) == 4.0  # the input state is untouched
    capped = rule.adjust(ScaleState(tf.constant(8.0), tf.constant(2, tf.int64), tf.constant(1, tf.int64)), True)
    assert float(capped.scale) == 8.0
    backed_off = rule.adjust(state, False)
    assert (float(backed_off.scale), int(backed_off.good_steps), int(backed_off.hysteresis_left)) == (2.0, 0, 0)
