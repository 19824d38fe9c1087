"""`kmix.callbacks.NaNGuard` in `model.fit`: rollbacks against runs that never saw the bad batch."""

import keras
import numpy as np
import pytest

import kmix
from kmix.callbacks import LearningRateWarmup, NaNGuard
from kmix.schedules import Scaled, Warmup
from tests.callbacks.helpers import MODES, Recorder, linear_data, linear_model
from tests.testing import assert_config_round_trip

BAD = 6  # the batch with x = inf
SETUPS = {
    # a plain optimizer: the NaN step corrupts the weights, the rollback repairs them
    "graph-float32-Adam": ("graph", "float32", lambda: keras.optimizers.Adam(0.01)),
    # a loss-scale optimizer: the step is skipped (scale halved); the rollback restores the scale
    "jit-mixed_float16-wrap(Adam)": ("jit", "mixed_float16", lambda: kmix.wrap(keras.optimizers.Adam(0.01))),
}


def make(setup, weights=None):
    mode, policy, optimizer = SETUPS[setup]
    keras.config.set_dtype_policy(policy)  # restored by tests/conftest.py
    keras.utils.set_random_seed(2)  # an initialization whose early steps overflow at 2^15, too
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=optimizer(), loss="mse", **MODES[mode])
    if weights is not None:
        model.set_weights(weights)
    model.optimizer.build(model.trainable_variables)  # built before fit: one trace of the train step, not two
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 3)).astype(np.float32)
    y = rng.normal(size=(10, 1)).astype(np.float32)
    bad = x.copy()
    bad[BAD] = np.inf
    return x, y, bad


def optimizer_state(model):
    """The optimizer's variables a rollback restores (all but the rate and the event counters)."""
    opt = model.optimizer
    skip = {"learning_rate", "skipped_steps", "overflow_counts", "min_scale_overflows"}
    return [v.numpy() for v in opt.variables if v.path.rsplit("/", 1)[-1] not in skip]


class StateAt(keras.callbacks.Callback):
    """Copies the weights and optimizer state at the end of batch `batch`."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.weights = self.model.get_weights()
            self.optimizer = optimizer_state(self.model)
            self.loss = logs["loss"]  # this batch's own (NaN) running loss
            opt = self.model.optimizer
            if isinstance(opt, kmix.LossScaleOptimizer):
                self.scale, self.skipped = float(opt.loss_scale), int(opt.skipped_steps)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_rollback_restores_bit_identical_state(setup):
    x, y, bad = data()
    model = make(setup)
    initial = model.get_weights()
    # rollback_after_skips=1: roll back even when the optimizer skipped the step.
    guard = NaNGuard(max_rollbacks=3, lr_factor=0.5, snapshot_every=4, rollback_after_skips=1)
    at_bad = StateAt(BAD)
    recorder = Recorder()
    model.fit(bad, y, batch_size=1, verbose=0, shuffle=False, callbacks=[guard, at_bad, recorder])

    # Reference: the same start trained on the first 4 batches only (the snapshot).
    reference = make(setup, initial)
    reference.fit(x[:4], y[:4], batch_size=1, verbose=0, shuffle=False)
    assert guard.rollbacks == [BAD + 1]
    for got, want in zip(at_bad.weights, reference.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(at_bad.optimizer, optimizer_state(reference)):
        np.testing.assert_array_equal(got, want)
    assert np.isnan(at_bad.loss)
    # The epoch's running loss restarts after the rollback, without the NaN.
    assert all(np.isfinite(logs["loss"]) for logs in recorder.logs[BAD + 1 :])
    assert float(model.optimizer.learning_rate) == np.float32(0.01) * np.float32(0.5)
    if isinstance(model.optimizer, kmix.LossScaleOptimizer):
        # The scale came back with the snapshot; the skip counter kept the NaN step.
        assert at_bad.scale == float(reference.optimizer.loss_scale) == 2.0**13
        assert at_bad.skipped == int(reference.optimizer.skipped_steps) + 1

    # Then it goes on with the rate halved: as the reference does on the remaining batches.
    reference.optimizer.learning_rate = float(reference.optimizer.learning_rate) * 0.5
    reference.fit(x[BAD + 1 :], y[BAD + 1 :], batch_size=1, verbose=0, shuffle=False)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_schedule_rate_is_scaled_and_follows_the_restored_step():
    # Linear model: each applied step moves w by exactly its learning rate.
    model = linear_model(jit_compile=True)
    recorder = Recorder()
    x, y = linear_data(12, bad=[5])
    model.fit(x, y, batch_size=1, verbose=0, shuffle=False,
              callbacks=[LearningRateWarmup(10), NaNGuard(snapshot_every=3, rollback_after_skips=1), recorder])
    lr = model.optimizer.inner_optimizer.get_config()["learning_rate"]
    revived = keras.saving.deserialize_keras_object(lr)
    assert isinstance(revived, Scaled) and revived.factor == 0.5
    assert isinstance(revived.schedule, Warmup) and revived.schedule.warmup_steps == 10

    warm = lambda s: 0.1 * s / 10  # noqa: E731  (float32 0.1 is close enough at atol 2e-6)
    w = recorder.first_weight()
    # Steps 0-4 applied; batch 5 is NaN: back to the snapshot after 3 steps (iterations 3),
    # then steps 3..8 of the warm-up at half the rate.
    np.testing.assert_allclose(w[:6], -np.cumsum([0] + [warm(s) for s in range(5)]), atol=2e-6)
    after = -sum(warm(s) for s in range(3)) - np.cumsum([0] + [0.5 * warm(s) for s in range(3, 9)])
    np.testing.assert_allclose(w[6:], after, atol=2e-6)
    assert int(model.optimizer.iterations) == 9


@pytest.mark.parametrize("mode", ["graph", "jit"])
def test_stops_after_max_rollbacks_naming_the_step(mode):
    model = linear_model(keras.optimizers.SGD(0.1), **MODES[mode])
    initial = model.get_weights()
    x, y = linear_data(8, bad=[2, 5])
    guard = NaNGuard(max_rollbacks=1, snapshot_every=100)
    with pytest.raises(FloatingPointError, match=r"training step 6 \(batch 5 of the epoch\)"):
        model.fit(x, y, batch_size=1, verbose=0, shuffle=False, callbacks=[guard])
    assert guard.rollbacks == [3]
    for got, want in zip(model.get_weights(), initial):  # the snapshot of train begin
        np.testing.assert_array_equal(got, want)
    assert float(model.optimizer.learning_rate) == np.float32(0.05)


def test_config_round_trip_and_bad_arguments():
    clone = assert_config_round_trip(
        NaNGuard(max_rollbacks=0, lr_factor=0.25, snapshot_every=7, rollback_after_skips=5)
    )
    assert (clone.max_rollbacks, clone.lr_factor, clone.snapshot_every) == (0, 0.25, 7)
    assert clone.rollback_after_skips == 5
    for kwargs, name in [
        (dict(max_rollbacks=-1), "max_rollbacks"),
        (dict(lr_factor=0.0), "lr_factor"),
        (dict(lr_factor=1.5), "lr_factor"),
        (dict(snapshot_every=0), "snapshot_every"),
        (dict(rollback_after_skips=0), "rollback_after_skips"),
    ]:
        with pytest.raises((TypeError, ValueError), match=f"`{name}`"):
            NaNGuard(**kwargs)


def wrapped_fit(bad_rows, callbacks=(), rows=None, weights=None):
    """`kmix.wrap(Adam)` under mixed_float16 (graph mode); `bad_rows` hold x = inf."""
    x, y, _ = data()
    x = x.copy()
    x[list(bad_rows)] = np.inf
    model = make("jit-mixed_float16-wrap(Adam)", weights)
    model.compile(optimizer=kmix.wrap(keras.optimizers.Adam(0.01)), loss="mse", jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    recorder = Recorder()
    rows = slice(None) if rows is None else rows
    model.fit(x[rows], y[rows], batch_size=1, verbose=0, shuffle=False, callbacks=[*callbacks, recorder])
    return model, recorder


def test_a_step_the_optimizer_skipped_is_not_rolled_back():
    guard = NaNGuard(snapshot_every=4)
    model, recorder = wrapped_fit([BAD], [guard])
    # Reference: the same run without the guard. The skip left the weights good,
    # so the guard must change nothing: same weights, same optimizer state, same rate.
    reference, reference_log = wrapped_fit([BAD])
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(optimizer_state(model), optimizer_state(reference)):
        np.testing.assert_array_equal(got, want)
    assert float(model.optimizer.learning_rate) == np.float32(0.01)
    assert guard.rollbacks == [] and guard.skips == [BAD + 1]
    assert int(model.optimizer.skipped_steps) == int(reference.optimizer.skipped_steps) >= 1
    # The running loss: NaN for the rest of the epoch without the guard, finite with it.
    assert np.isnan(reference_log.logs[-1]["loss"])
    assert all(np.isfinite(logs["loss"]) for logs in recorder.logs[BAD + 1 :])


def test_non_finite_losses_in_a_row_roll_back_after_rollback_after_skips():
    guard = NaNGuard(snapshot_every=4, rollback_after_skips=3)
    at_third = StateAt(BAD + 2)
    model, _ = wrapped_fit(range(BAD, BAD + 3), [guard, at_third])
    # Two skips let through, the third in a row rolls back to the snapshot of step 4.
    assert guard.skips == [BAD + 1, BAD + 2] and guard.rollbacks == [BAD + 3]
    reference, _ = wrapped_fit([], rows=slice(0, 4))  # the same start, the first 4 batches
    for got, want in zip(at_third.weights, reference.get_weights()):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(at_third.optimizer, optimizer_state(reference)):
        np.testing.assert_array_equal(got, want)
    assert float(model.optimizer.learning_rate) == np.float32(0.01) * np.float32(0.5)
