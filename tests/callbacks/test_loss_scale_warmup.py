"""`kmix.callbacks.LossScaleWarmup` in `model.fit`, against the hand-run scale trajectory.

A float16 Dense(1) (zero init, learning rate 0, so every step sees the same
gradient) on x = 1, y = 20 under MSE: the gradient reaching the float16
output is scale * 2 * 20 = 40 * scale, finite up to scale 2^10 (40960) and
inf from 2^11 (81920 > 65504). So the largest usable scale is 2^10.
"""

import os
import tempfile

import keras
import numpy as np
import pytest

import kmix
from kmix.callbacks import LossScaleWarmup
from tests.callbacks.helpers import MODES, Recorder, linear_model
from tests.testing import assert_config_round_trip


def float16_model(scaling=None, **compile_kwargs):
    keras.config.set_dtype_policy("mixed_float16")  # restored by tests/conftest.py
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    optimizer = kmix.wrap(keras.optimizers.SGD(0.0), **(scaling or {}))
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    model.optimizer.build(model.trainable_variables)  # built before fit: one trace of the train step, not two
    return model


def data(n):
    return np.ones((n, 1), np.float32), np.full((n, 1), 20.0, np.float32)


def warmup_trajectory(n, initial=2**7, interval=20, limit=2**10):
    """Scale after each step: x2 every `interval` finite steps until it passes `limit`."""
    scale, good, skipped, rows = float(initial), 0, 0, []
    warming = True
    for _ in range(n):
        if scale > limit:  # overflow: skip, halve, warm-up over (interval 2000)
            skipped, good, scale, warming = skipped + 1, 0, scale / 2, False
        else:
            good += 1
            if good == (interval if warming else 2000):
                good, scale = 0, scale * 2
        rows.append((scale, skipped))
    return rows


@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_fewer_skipped_steps_than_starting_at_2_15(mode):
    n = 100
    baseline, warm = Recorder(), Recorder()
    x, y = data(n)
    float16_model(**MODES[mode]).fit(x, y, batch_size=1, verbose=0, callbacks=[baseline])
    model = float16_model(**MODES[mode])
    callback = LossScaleWarmup(initial_scale=2**7, growth_interval=20, steps=1000)
    model.fit(x, y, batch_size=1, verbose=0, callbacks=[callback, warm])
    print(
        f"\n[{mode}] skipped steps in the first {n}: starting at 2**15: {baseline.skipped[-1]} "
        f"(scale {baseline.scales[-1]:g}); LossScaleWarmup(2**7, growth_interval=20): "
        f"{warm.skipped[-1]} (scale {warm.scales[-1]:g}, warm-up ended at step {callback.finished_at})"
    )
    # Starting at 2^15: 2^15, 2^14, 2^13, 2^12, 2^11 overflow, then 2^10 holds.
    assert baseline.skipped[-1] == 5 and baseline.scales[-1] == 2.0**10
    assert list(zip(warm.scales, warm.skipped)) == warmup_trajectory(n)
    assert warm.skipped[-1] == 1 < baseline.skipped[-1]
    assert callback.finished_at == 81  # 2^11 reached after 80 steps, overflowed at the 81st
    assert int(model.optimizer.current_growth_interval) == model.optimizer.growth_interval == 2000


def test_ends_after_steps_without_overflow():
    model = float16_model()
    callback = LossScaleWarmup(initial_scale=2**5, growth_interval=4, steps=10)
    recorder = Recorder()
    x, y = data(16)
    model.fit(x, y, batch_size=1, verbose=0, callbacks=[callback, recorder])
    # x2 after steps 4 and 8; at 10 the optimizer's interval (2000) is back: no growth at 12, 16.
    assert recorder.scales == [32.0] * 3 + [64.0] * 4 + [128.0] * 9
    assert callback.finished_at == 10 and recorder.skipped[-1] == 0
    assert int(model.optimizer.current_growth_interval) == 2000


def test_resumed_model_continues_and_finished_warmup_is_not_restarted():
    model = float16_model(jit_compile=True)
    x, y = data(30)
    model.fit(x, y, batch_size=1, verbose=0, callbacks=[LossScaleWarmup()])
    assert float(model.optimizer.loss_scale) == 2.0**8  # mid warm-up after 30 steps
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    callback, recorder = LossScaleWarmup(), Recorder()
    x, y = data(70)
    loaded.fit(x, y, batch_size=1, verbose=0, callbacks=[callback, recorder])
    assert list(zip(recorder.scales, recorder.skipped)) == warmup_trajectory(100)[30:]
    assert callback.finished_at == 81
    # A third fit starts from a finished warm-up: nothing is lowered again.
    callback = LossScaleWarmup()
    loaded.fit(x[:3], y[:3], batch_size=1, verbose=0, callbacks=[callback])
    assert float(loaded.optimizer.loss_scale) == 2.0**10 and callback.finished_at is None


def test_fixed_scale_warns_and_does_nothing():
    model = linear_model()  # float32: kmix.wrap fixes the scale at 1
    with pytest.warns(UserWarning, match="does nothing"):
        model.fit(np.ones((2, 1)), np.ones((2, 1)), verbose=0, callbacks=[LossScaleWarmup()])
    assert float(model.optimizer.loss_scale) == 1.0


def test_initial_scale_outside_the_optimizers_bounds():
    model = float16_model(dict(min_scale=2.0**9))
    with pytest.raises(ValueError, match="initial_scale=128.0.*min_scale=512.0"):
        model.fit(*data(2), verbose=0, callbacks=[LossScaleWarmup()])


def test_config_round_trip_and_bad_arguments():
    clone = assert_config_round_trip(LossScaleWarmup(initial_scale=2**4, growth_interval=5, steps=50))
    assert (clone.initial_scale, clone.growth_interval, clone.steps) == (16.0, 5, 50)
    for kwargs, name in [
        (dict(initial_scale=0), "initial_scale"),
        (dict(initial_scale=float("inf")), "initial_scale"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(steps=2.0), "steps"),
    ]:
        with pytest.raises((TypeError, ValueError), match=f"`{name}`"):
            LossScaleWarmup(**kwargs)
