"""`kmix.callbacks.LossScaleMonitor` in `model.fit`: logs against the hand-run scale trajectory.

A float16 model (Dense(1), zero init) on x = 1 is fine at the default scale
2^15; a batch with x = 1e4 makes the kernel's gradient overflow float16 at
any scale used here (the bias's does not). So each such batch is skipped and
halves the scale: after k of them the scale is 2^15 / 2^k, exactly.
"""

import csv
import os
import tempfile
import warnings

import keras
import numpy as np
import pytest

import kmix
from kmix.callbacks import LossScaleMonitor
from tests.callbacks.helpers import MODES, Recorder, linear_data, linear_model
from tests.testing import assert_config_round_trip

BAD = (2, 5)  # batches whose gradient overflows, in every epoch


def float16_model(**compile_kwargs):
    keras.config.set_dtype_policy("mixed_float16")  # restored by tests/conftest.py
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(1e-3)), loss="mse", **compile_kwargs)
    return model


def overflow_data(n=8):
    x = np.ones((n, 1), np.float32)
    x[list(BAD)] = 1e4
    return x, np.full((n, 1), 0.01, np.float32)


def hand_trajectory(epochs, n=8):
    """(scale, skipped so far) after every batch, per the optimizer's documented rule."""
    rows, skipped = [], 0
    for _ in range(epochs):
        for batch in range(n):
            skipped += batch in BAD
            rows.append((2.0**15 / 2**skipped, skipped))
    return rows


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_logged_scale_is_the_optimizers(mode, capsys):
    model = float16_model(**MODES[mode])
    recorder = Recorder()
    monitor = LossScaleMonitor()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "log.csv")
        x, y = overflow_data()
        history = model.fit(x, y, batch_size=1, epochs=2, verbose=0, shuffle=False,
                            callbacks=[monitor, recorder, keras.callbacks.CSVLogger(path)])
        with open(path) as f:
            rows = list(csv.DictReader(f))
    want = hand_trajectory(2)
    logged = [(logs["loss_scale"], logs["skipped_steps"]) for logs in recorder.logs]
    assert logged == want
    assert logged == list(zip(recorder.scales, recorder.skipped))  # read from the optimizer
    # Epoch logs: History and CSVLogger (which comes after the monitor) see them.
    assert history.history["loss_scale"] == [2.0**13, 2.0**11]
    assert history.history["skipped_steps"] == [2, 4]
    assert history.history["overflow_rate"] == [2 / 8, 2 / 8]
    assert [float(r["loss_scale"]) for r in rows] == [2.0**13, 2.0**11]
    assert [float(r["overflow_rate"]) for r in rows] == [0.25, 0.25]
    # The report names the kernel (4 overflows) and not the bias.
    assert monitor.report == model.optimizer.overflow_report() == [(model.weights[0].path, 4)]
    out = capsys.readouterr().out
    assert "4 step(s) skipped" in out and model.weights[0].path in out
    assert model.weights[1].path not in out


def test_log_every_thins_the_batch_logs(capsys):
    model = float16_model()
    recorder = Recorder()
    x, y = overflow_data()
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False,
              callbacks=[LossScaleMonitor(log_every=3), recorder])
    has = ["loss_scale" in logs for logs in recorder.logs]
    assert has == [False, False, True, False, False, True, False, False]
    assert recorder.logs[5]["loss_scale"] == 2.0**13


def test_nothing_printed_without_skipped_steps(capsys):
    model = float16_model()
    x, y = overflow_data()
    monitor = LossScaleMonitor()
    model.fit(x[:2], y[:2], batch_size=1, verbose=0, callbacks=[monitor])
    assert capsys.readouterr().out == "" and monitor.report == []


def min_scale_fit(on_min_scale, mode="graph"):
    """float32: kmix.wrap fixes the scale at 1 = min_scale; x = inf at batches 2 and 4."""
    model = linear_model(**MODES[mode])
    x, y = linear_data(6, bad=[2, 4])
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False,
              callbacks=[LossScaleMonitor(on_min_scale=on_min_scale)])
    return model


@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_raise_names_the_step_and_the_scale(mode, capsys):
    with pytest.raises(FloatingPointError) as info:
        min_scale_fit("raise", mode)
    message = str(info.value)
    # batch 2 is the third step run: two applied, one skipped
    assert "training step 3 (epoch 0, batch 2)" in message
    assert "loss_scale=1" in message


def test_warn_warns_once_and_ignore_is_silent(capsys):
    with pytest.warns(RuntimeWarning, match="loss scale was already at its minimum") as record:
        model = min_scale_fit("warn")
    assert len([w for w in record if "minimum" in str(w.message)]) == 1
    assert int(model.optimizer.min_scale_overflows) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        min_scale_fit("ignore")


def test_needs_a_kmix_optimizer():
    model = linear_model(keras.optimizers.SGD(0.1))
    x, y = linear_data(2)
    with pytest.raises(ValueError, match="kmix.wrap"):
        model.fit(x, y, verbose=0, callbacks=[LossScaleMonitor()])


def test_config_round_trip_and_bad_arguments():
    clone = assert_config_round_trip(LossScaleMonitor(on_min_scale="raise", log_every=10))
    assert (clone.on_min_scale, clone.log_every) == ("raise", 10)
    with pytest.raises(ValueError, match="`on_min_scale`.*Received: on_min_scale='stop'"):
        LossScaleMonitor(on_min_scale="stop")
    with pytest.raises(ValueError, match="`log_every`"):
        LossScaleMonitor(log_every=0)
