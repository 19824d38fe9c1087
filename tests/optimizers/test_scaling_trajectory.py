"""The scale trajectory equals a plain-Python run of the documented pseudo-code."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import kmix


def simulate(overflows, initial_scale, growth_interval, growth_factor, backoff_factor,
             hysteresis, min_scale, max_scale, dynamic=True):
    """The class docstring's pseudo-code, line for line, in plain Python."""
    scale, good, left, skipped = initial_scale, 0, hysteresis, 0
    trajectory = []
    for overflow in overflows:
        if overflow:
            skipped += 1
            good = 0
            left -= 1
            if dynamic and left <= 0:
                scale = max(scale * backoff_factor, min_scale)
        else:
            good += 1
            if dynamic and good == growth_interval:
                good = 0
                left = hysteresis
                scale = min(scale * growth_factor, max_scale)
        trajectory.append((scale, good, skipped))
    return trajectory


SETTINGS = [
    # torch.amp.GradScaler's defaults, bounds out of reach
    dict(initial_scale=2.0**16, growth_interval=20, growth_factor=2.0, backoff_factor=0.5,
         hysteresis=1, min_scale=2.0**-30, max_scale=2.0**60),
    # Megatron-LM: hysteresis 2, floor at 1
    dict(initial_scale=2.0**4, growth_interval=10, growth_factor=2.0, backoff_factor=0.5,
         hysteresis=2, min_scale=1.0, max_scale=2.0**24),
    # both bounds reached often
    dict(initial_scale=8.0, growth_interval=3, growth_factor=4.0, backoff_factor=0.25,
         hysteresis=3, min_scale=2.0, max_scale=64.0),
    # fixed scale still skips
    dict(initial_scale=2.0**10, growth_interval=5, growth_factor=2.0, backoff_factor=0.5,
         hysteresis=1, min_scale=1.0, max_scale=2.0**24, dynamic=False),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=["torch", "megatron", "bounds", "fixed"])
def test_trajectory_matches_simulation(settings):
    rng = np.random.default_rng(len(str(settings)))
    # Bursts of overflows as well as isolated ones.
    overflows = rng.random(3000) < 0.08
    overflows[1000:1012] = True
    var = keras.Variable(np.ones(3, np.float32), name="w")
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(1e-3), **settings)
    opt.build([var])

    @tf.function
    def steps(bad):
        """One `apply` per entry of `bad`, in a loop in one graph (3000 calls from Python cost seconds)."""
        read = lambda: (opt.loss_scale, opt.good_steps.value, opt.skipped_steps.value)  # noqa: E731
        arrays = [tf.TensorArray(t.dtype, size=len(overflows)) for t in read()]
        for i in tf.range(len(overflows)):
            grad = tf.where(bad[i], tf.constant([1.0, np.inf, 1.0]), tf.ones(3))
            opt.apply([grad], [var])
            arrays = [a.write(i, t) for a, t in zip(arrays, read())]  # read after this step's apply
        return [a.stack() for a in arrays]

    got = list(zip(*(t.numpy().astype(float).tolist() for t in steps(tf.constant(overflows)))))
    expected = simulate(overflows, **settings)
    first = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != tuple(map(float, e))), None)
    assert first is None, f"step {first}: got {got[first]}, expected {expected[first]}"
    assert int(opt.iterations) == int((~overflows).sum())
    assert opt.overflow_counts.numpy().tolist() == [int(overflows.sum())]
    print(f"{settings}: {len(overflows)} steps, {int(overflows.sum())} skipped, "
          f"scale range [{min(e[0] for e in expected)}, {max(e[0] for e in expected)}]")


def test_min_scale_overflows_counted():
    var = keras.Variable(np.ones(2, np.float32))
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0, min_scale=1.0)
    opt.build([var])
    bad = [tf.constant([np.nan, 1.0])]
    for _ in range(5):  # 4 -> 2 -> 1 -> 1 -> 1: the last three overflows were at the floor
        opt.apply(bad, [var])
    assert float(opt.loss_scale) == 1.0
    assert int(opt.min_scale_overflows) == 3
    assert int(opt.skipped_steps) == 5


def test_overflow_report_sorted_by_count():
    a = keras.Variable(np.ones(2, np.float32), name="a")
    b = keras.Variable(np.ones(2, np.float32), name="b")
    c = keras.Variable(np.ones(2, np.float32), name="c")
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1.0)
    opt.build([a, b, c])
    ok, bad = tf.ones(2), tf.constant([np.inf, 0.0])
    for grads in ([ok, bad, ok], [ok, bad, bad], [ok, bad, ok], [ok, ok, ok]):
        opt.apply(grads, [a, b, c])
    assert opt.overflow_report() == [(b.path, 3), (c.path, 1)]
    assert opt.overflow_report(top=1) == [(b.path, 3)]
    assert int(opt.skipped_steps) == 3
    np.testing.assert_array_equal(a.numpy(), np.float32(1) - np.float32(0.1))  # one finite SGD step


def test_interval_lowered_below_the_count_grows_at_the_next_finite_step():
    var = keras.Variable(np.ones(2, np.float32))
    opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=8.0, growth_interval=20)
    opt.build([var])
    for _ in range(10):
        opt.apply([tf.ones(2)], [var])
    opt.current_growth_interval.assign(5)  # what LossScaleWarmup does when it ends
    opt.apply([tf.ones(2)], [var])
    assert float(opt.loss_scale) == 16.0 and int(opt.good_steps) == 0
    for _ in range(5):
        opt.apply([tf.ones(2)], [var])
    assert float(opt.loss_scale) == 32.0
