"""`kmix.callbacks.LossScaleMonitor` in `model.fit`: logs against the hand-run scale trajectory.

A float16 model (Dense(1), zero init) on x = 1 is fine at the default scale
2^15; a batch with x = 1e4 makes the kernel's gradient overflow float16 at
any scale used here (the bias's does not). So each such batch is skipped and
halves the scale: after k of them the scale is 2^15 / 2^k, exactly.
"""

import csv
import importlib.util
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
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def float16_model(**compile_kwargs):
    keras.config.set_dtype_policy("mixed_float16")  # restored by tests/conftest.py
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(1e-3)), loss="mse", **compile_kwargs)
    if not compile_kwargs.get("run_eagerly"):  # eager: left unbuilt, for the monitor to build at train begin
        model.optimizer.build(model.trainable_variables)  # built before fit: one trace of the train step, not two
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


def test_the_monitor_builds_the_optimizer_so_that_the_first_step_traces_once():
    """Keras builds an unbuilt optimizer inside the first trace of the train step, and a first trace that
    creates variables is traced again; the monitor builds it at train begin: as many traces as with the
    optimizer built by hand, and the same weights."""
    traces = []

    class Counted(keras.layers.Layer):
        def call(self, x):
            traces.append(1)  # Python runs the call only while a step is traced
            return x

    def run(by_hand, callbacks):
        keras.config.set_dtype_policy("mixed_float16")  # restored by tests/conftest.py
        model = keras.Sequential([keras.Input((1,)), Counted(), keras.layers.Dense(1, kernel_initializer="zeros")])
        model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(1e-3)), loss="mse")
        if by_hand:
            model.optimizer.build(model.trainable_variables)
        traces.clear()
        model.fit(*overflow_data(), batch_size=1, shuffle=False, verbose=0, callbacks=callbacks)
        return len(traces), model.get_weights()

    monitored, weights = run(False, [LossScaleMonitor()])
    by_hand, by_hand_weights = run(True, [LossScaleMonitor()])
    lazy, lazy_weights = run(False, [])
    assert monitored == by_hand <= lazy, (monitored, by_hand, lazy)
    for ours, theirs, keras_own in zip(weights, by_hand_weights, lazy_weights):
        np.testing.assert_array_equal(ours, theirs)  # the same traced step
        np.testing.assert_allclose(ours, keras_own, rtol=1e-6)  # a step traced otherwise: float32's rounding


def test_log_every_thins_the_batch_logs(capsys):
    model = float16_model()
    recorder = Recorder()
    x, y = overflow_data()
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False,
              callbacks=[LossScaleMonitor(log_every=3), recorder])
    has = ["loss_scale" in logs for logs in recorder.logs]
    # Every third batch, and the epoch's last, so that the epoch logs have the keys.
    assert has == [False, False, True, False, False, True, False, True]
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


def read_tensorboard_scalars(log_dir):
    """{tag: [values by step]} from the event files under `log_dir`/train, read back with TensorFlow."""
    import tensorflow as tf

    scalars = {}
    train = os.path.join(log_dir, "train")
    for name in sorted(os.listdir(train)):
        for record in tf.data.TFRecordDataset(os.path.join(train, name)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "scalars":
                    continue  # the model's config, written as text
                scalars.setdefault(value.tag, []).append((event.step, float(tf.make_ndarray(value.tensor))))
    return {tag: [v for _, v in sorted(rows)] for tag, rows in scalars.items()}


@pytest.mark.parametrize("monitor_first", [True, False], ids=["monitor_first", "monitor_last"])
def test_every_callback_sees_the_keys_whatever_the_order(monitor_first, tmp_path):
    model = float16_model()
    x, y = overflow_data()
    csv_path, log_dir = str(tmp_path / "log.csv"), str(tmp_path / "tb")
    others = [keras.callbacks.CSVLogger(csv_path), Recorder()]
    if HAS_TENSORBOARD:  # tf.summary needs the tensorboard package (a test dependency)
        others.append(keras.callbacks.TensorBoard(log_dir))
    monitor = LossScaleMonitor()
    callbacks = [monitor, *others] if monitor_first else [*others, monitor]
    model.fit(x, y, batch_size=1, epochs=2, verbose=0, shuffle=False, callbacks=callbacks)
    # The reference: the documented scale rule run by hand, two bad batches of 8 per epoch.
    want = hand_trajectory(2)
    scales, skipped = [want[7][0], want[15][0]], [want[7][1], want[15][1]]
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["loss_scale"]) for r in rows] == scales == [2.0**13, 2.0**11]
    assert [int(float(r["skipped_steps"])) for r in rows] == skipped
    assert [float(r["overflow_rate"]) for r in rows] == [2 / 8, 2 / 8]
    if HAS_TENSORBOARD:
        board = read_tensorboard_scalars(log_dir)
        assert board["epoch_loss_scale"] == scales
        assert board["epoch_skipped_steps"] == skipped
        assert board["epoch_overflow_rate"] == [0.25, 0.25]
    # Batch logs of a callback listed before the monitor have them too.
    recorder = others[1]
    assert [(logs["loss_scale"], logs["skipped_steps"]) for logs in recorder.logs] == want
    assert type(model.train_function).__name__ != "_LoggingStep"  # restored after fit


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tf.summary needs the tensorboard package")
def test_tensorboard_is_installed_for_the_order_test():
    """Marks, in the test report, whether the TensorBoard half of the order test ran."""
    assert HAS_TENSORBOARD


def test_train_function_is_restored_after_a_raise():
    model = linear_model()
    x, y = linear_data(6, bad=[2])
    with pytest.raises(FloatingPointError):
        model.fit(x, y, batch_size=1, verbose=0, shuffle=False,
                  callbacks=[LossScaleMonitor(on_min_scale="raise")])
    assert type(model.train_function).__name__ != "_LoggingStep"
    recorder = Recorder()
    model.fit(x[:2], y[:2], batch_size=1, verbose=0, callbacks=[recorder])  # no monitor: no keys
    assert all("loss_scale" not in logs for logs in recorder.logs)
