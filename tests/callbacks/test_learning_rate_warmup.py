"""`kmix.callbacks.LearningRateWarmup` in `model.fit`: the rate of every step, by hand.

The linear model of `tests/callbacks/helpers.py` moves its weight by exactly
the learning rate of each applied SGD step, so the recorded weights are
compared with the cumulative sum of the warm-up formula computed in float64.
"""

import math
import os
import tempfile

import keras
import numpy as np
import pytest

import kmix
from kmix.callbacks import LearningRateWarmup
from kmix.schedules import Warmup
from tests.callbacks.helpers import MODES, Recorder, StopAt, linear_data, linear_model
from tests.testing import assert_config_round_trip


def rate(step, base, warmup_steps, initial=0.0, shape="linear"):
    """The warm-up rate of step `step` (0-based count of applied steps), in float64."""
    if step >= warmup_steps:
        return base(step)
    t = step / warmup_steps
    f = {
        "linear": initial + (1 - initial) * t,
        "exponential": initial ** (1 - t),
        "cosine": initial + (1 - initial) * (1 - math.cos(math.pi * t)) / 2,
    }[shape]
    return base(step) * f


def constant(value):
    return lambda step: float(np.float32(value))


def assert_steps_used(recorder, rates, every=1):
    """The weight fell by the cumulative rates (read after every `every` steps)."""
    w = recorder.first_weight()
    want = -np.cumsum(rates)[every - 1 :: every]
    np.testing.assert_allclose(w[1:], want, rtol=0, atol=2e-6)


CASES = {
    "graph-linear": (MODES["graph"], 1, "linear", 0.0),
    "eager-cosine": (MODES["eager"], 1, "cosine", 0.1),
    "jit-exponential": (MODES["jit"], 1, "exponential", 0.01),
    "jit-steps_per_execution=3": (MODES["jit"], 3, "linear", 0.2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rate_at_every_step(case):
    mode, spe, shape, initial = CASES[case]
    model = linear_model(steps_per_execution=spe, **mode)
    recorder = Recorder()
    warmup = LearningRateWarmup(8, initial=initial, shape=shape)
    x, y = linear_data(12)
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False, callbacks=[warmup, recorder])
    rates = [rate(s, constant(0.1), 8, initial, shape) for s in range(12)]
    assert_steps_used(recorder, rates, every=spe)
    assert isinstance(warmup.schedule, Warmup) and warmup.schedule.base == float(np.float32(0.1))
    assert int(model.optimizer.iterations) == 12


def test_schedule_rate_is_wrapped_and_keeps_running():
    decay = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=5, decay_rate=0.5)
    model = linear_model(kmix.wrap(keras.optimizers.SGD(decay)), jit_compile=True)
    recorder = Recorder()
    x, y = linear_data(10)
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False,
              callbacks=[LearningRateWarmup(4, shape="cosine"), recorder])
    rates = [rate(s, lambda k: 0.2 * 0.5 ** (k / 5), 4, 0.0, "cosine") for s in range(10)]
    assert_steps_used(recorder, rates)


@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_skipped_step_does_not_advance_the_warmup(mode):
    model = linear_model(**MODES[mode])
    recorder = Recorder()
    x, y = linear_data(10, bad=[3, 4])  # NaN loss: kmix.wrap skips both steps
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False,
              callbacks=[LearningRateWarmup(6), recorder])
    applied = iter(rate(s, constant(0.1), 6) for s in range(8))
    rates = [0.0 if i in (3, 4) else next(applied) for i in range(10)]
    assert_steps_used(recorder, rates)
    assert int(model.optimizer.iterations) == 8 and int(model.optimizer.skipped_steps) == 2


def test_resume_from_saved_model_continues_the_warmup():
    x, y = linear_data(5)
    model = linear_model(jit_compile=True)
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False, callbacks=[LearningRateWarmup(12)])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    assert int(loaded.optimizer.iterations) == 5
    recorder = Recorder()
    loaded.fit(x, y, batch_size=1, epochs=2, verbose=0, shuffle=False,
               callbacks=[LearningRateWarmup(12), recorder])
    w0 = recorder.first_weight()[0]
    np.testing.assert_allclose(w0, -sum(rate(s, constant(0.1), 12) for s in range(5)), atol=1e-6)
    rates = [rate(s, constant(0.1), 12) for s in range(5, 15)]
    np.testing.assert_allclose(recorder.first_weight()[1:] - w0, -np.cumsum(rates), atol=2e-6)


def test_resume_with_backup_and_restore_continues_the_warmup():
    x, y = linear_data(4)
    with tempfile.TemporaryDirectory() as tmp:
        def callbacks(*extra):
            # BackupAndRestore first: the warm-up is installed when fit hands over the
            # model, before any on_train_begin, so the restore finds the same layout.
            return [keras.callbacks.BackupAndRestore(tmp), LearningRateWarmup(10), *extra]

        first = linear_model()
        with pytest.raises(RuntimeError, match="interrupted"):
            first.fit(x, y, batch_size=1, epochs=5, verbose=0, shuffle=False,
                      callbacks=callbacks(StopAt(1)))
        assert int(first.optimizer.iterations) == 8
        second, recorder = linear_model(), Recorder()
        second.fit(x, y, batch_size=1, epochs=5, verbose=0, shuffle=False,
                   callbacks=callbacks(recorder))
    assert int(second.optimizer.iterations) == 20
    rates = [rate(s, constant(0.1), 10) for s in range(20)]
    np.testing.assert_allclose(recorder.first_weight(), -np.cumsum([0.0] + rates)[8:], atol=2e-6)


def test_second_fit_keeps_or_replaces_the_warmup():
    model = linear_model()
    x, y = linear_data(3)
    model.fit(x, y, batch_size=1, verbose=0, callbacks=[LearningRateWarmup(10)])
    installed = model.optimizer.inner_optimizer.get_config()["learning_rate"]
    recorder = Recorder()
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False,
              callbacks=[LearningRateWarmup(10), recorder])  # same: kept, steps 3..5
    assert model.optimizer.inner_optimizer.get_config()["learning_rate"] == installed
    np.testing.assert_allclose(np.diff(recorder.first_weight()),
                               [-rate(s, constant(0.1), 10) for s in (3, 4, 5)], atol=1e-6)
    recorder = Recorder()
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False,
              callbacks=[LearningRateWarmup(20, initial=0.5), recorder])  # other: replaced, retraced
    np.testing.assert_allclose(np.diff(recorder.first_weight()),
                               [-rate(s, constant(0.1), 20, 0.5) for s in (6, 7, 8)], atol=1e-6)


def test_config_round_trip():
    callback = LearningRateWarmup(500, initial=0.01, shape="exponential")
    clone = assert_config_round_trip(callback)
    assert (clone.warmup_steps, clone.initial, clone.shape) == (500, 0.01, "exponential")


@pytest.mark.parametrize(
    "kwargs,name",
    [(dict(warmup_steps="10"), "warmup_steps"), (dict(warmup_steps=10, initial=-1), "initial"),
     (dict(warmup_steps=10, shape="step"), "shape")],
)
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=f"`{name}`"):
        LearningRateWarmup(**kwargs)
