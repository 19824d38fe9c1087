"""`kmix.LossScaleOptimizer` inside `model.fit`: skipped steps, Keras parity, every optimizer."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import kmix


def make_model(seed=0, policy=None):
    keras.utils.set_random_seed(seed)
    if policy:
        keras.config.set_dtype_policy(policy)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


def make_data(n=48, bad_rows=()):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
    for r in bad_rows:
        x[r, 0] = np.inf
    return x, y


class Recorder(keras.callbacks.Callback):
    """Copies the model's and the inner optimizer's variables after every batch."""

    def on_train_begin(self, logs=None):
        self.states = [self.snapshot()]

    def on_train_batch_end(self, batch, logs=None):
        self.states.append(self.snapshot())

    def snapshot(self):
        opt = self.model.optimizer
        inner = [v.numpy().copy() for v in opt.inner_optimizer.variables] if opt.built else []
        return [w.copy() for w in self.model.get_weights()], inner


MODES = {"eager": dict(run_eagerly=True), "graph": dict(), "jit": dict(jit_compile=True)}


@pytest.mark.parametrize("mode", MODES)
def test_skipped_step_leaves_everything_bit_identical(mode):
    model = make_model()
    inner = keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=None)
    opt = kmix.wrap(inner)  # float32 policy: fixed scale 1, still skips
    model.compile(optimizer=opt, loss="mse", **MODES[mode])
    opt.build(model.trainable_variables)  # here, not inside fit's first trace (which traces it twice then)
    x, y = make_data(bad_rows=[20])  # batch 2 of 8-row batches holds an inf
    rec = Recorder()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[rec])
    before, after = rec.states[2], rec.states[3]  # around batch index 2
    for a, b in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(a, b)
    # The finite steps did move the weights.
    assert not np.array_equal(rec.states[1][0][0], rec.states[0][0][0])
    assert not np.array_equal(rec.states[4][0][0], rec.states[3][0][0])
    assert int(opt.skipped_steps) == 1
    assert int(opt.iterations) == 5
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("jit", [False, True])
def test_same_weights_as_keras_loss_scale_optimizer(jit):
    """Under mixed_float16, with Keras's growth/backoff settings, kmix == Keras step for step."""
    x, y = make_data()
    weights = {}
    for name in ("keras", "kmix"):
        model = make_model(policy="mixed_float16")
        inner = keras.optimizers.Adam(1e-2)
        if name == "keras":
            opt = keras.optimizers.LossScaleOptimizer(inner, dynamic_growth_steps=2)
        else:
            opt = kmix.wrap(inner, growth_interval=2, fused_update=False)  # Keras's Adam arithmetic: bitwise
        model.compile(optimizer=opt, loss="mse", jit_compile=jit)
        opt.build(model.trainable_variables)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights[name] = (model.get_weights(), float(opt.dynamic_scale.numpy()), int(opt.iterations))
    # The scale grew and backed off along the way (4 of 12 steps overflow), identically.
    assert weights["kmix"][1:] == weights["keras"][1:] == (2.0**15, 8)
    for a, b in zip(*(weights[k][0] for k in ("keras", "kmix"))):
        np.testing.assert_array_equal(a, b)


# Every optimizer, trained side by side in one `fit` (`Towers`): kmix hands each inner optimizer
# the unscaled gradients inside one `tf.cond`, whatever it does with them.
OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "Adam": lambda: keras.optimizers.Adam(1e-2),
    "AdamW": lambda: keras.optimizers.AdamW(1e-2),
    "RMSprop": lambda: keras.optimizers.RMSprop(1e-2),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "Adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "Adamax": lambda: keras.optimizers.Adamax(1e-2),
    "Nadam": lambda: keras.optimizers.Nadam(1e-2),
    "Lion": lambda: keras.optimizers.Lion(1e-3),
    "Adafactor": lambda: keras.optimizers.Adafactor(1e-2),
    "Ftrl": lambda: keras.optimizers.Ftrl(0.1),
    "Lamb": lambda: keras.optimizers.Lamb(1e-2),
    "clipnorm": lambda: keras.optimizers.Adam(1e-2, clipnorm=0.1),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.05, global_clipnorm=0.1),
    "schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)
    ),
}


def ema_adam():
    """EMA's final overwrite (`finalize_variable_values`) is done for the model's own optimizer only:
    tested in its own compiled model, through Keras's train_step."""
    return keras.optimizers.Adam(1e-2, use_ema=True, ema_overwrite_frequency=3)


def wrap_like_float32(opt):
    # Keras's own update (the fused Adam kernel rounds differently: tests/optimizers/test_updates_fused_adam.py).
    return kmix.wrap(opt, dynamic=True, initial_scale=2.0**15, growth_interval=2, fused_update=False)


def fit_without_the_bad_batch(model, x, y, wrapped, opts):
    """Fits (kmix: 2 steps per execution); the bare reference skips the bad batch (rows 8-15) by hand.

    The reference is compiled with 1 step per execution: the same steps in the same order, a smaller graph.
    """
    if wrapped:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        for opt in opts:
            assert int(opt.skipped_steps) == 1
    else:
        keep = np.ones(len(x), bool)
        keep[8:16] = False
        model.fit(x[keep], y[keep], batch_size=8, epochs=1, shuffle=False, verbose=0)


def test_ema_matches_unwrapped():
    """A float32 model: scaling by 2^15 and back is exact, so kmix == the bare optimizer, a skipped batch left out."""
    x, y = make_data(bad_rows=[13])
    runs = {}
    for wrapped in (False, True):
        model = make_model()
        opt = wrap_like_float32(ema_adam()) if wrapped else ema_adam()
        model.compile(optimizer=opt, loss="mse", steps_per_execution=2 if wrapped else 1)
        opt.build(model.trainable_variables)
        fit_without_the_bad_batch(model, x, y, wrapped, [opt])
        runs[wrapped] = model.get_weights()
    for a, b in zip(runs[False], runs[True]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def make_tower():
    """A 2-D kernel and a 1-D bias: every optimizer's update traced per variable, 15 times, so few variables.

    A bare `Dense` layer, built: 31 of them per test, a `Sequential` around each would only cost.
    """
    keras.utils.set_random_seed(0)
    tower = keras.layers.Dense(1)
    tower.build((None, 6))
    return tower


class Towers(keras.Model):
    """`make_tower()` once per optimizer, side by side: each train step steps each with its own optimizer.

    What Keras's train_step does for one (scale_loss, gradient, apply), done per tower.
    """

    def __init__(self, optimizers, **kwargs):
        super().__init__(**kwargs)
        self.towers = [make_tower() for _ in optimizers]  # the same seed: the same start each
        self.tower_optimizers = optimizers
        for tower, opt in zip(self.towers, optimizers):
            opt.build(tower.trainable_variables)  # before the traced step: no variables made in its loop

    def call(self, x):
        return [tower(x) for tower in self.towers]

    def train_step(self, data):
        x, y = data
        for tower, opt in zip(self.towers, self.tower_optimizers):
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(keras.ops.mean(keras.ops.square(tower(x, training=True) - y)))
            opt.apply(tape.gradient(loss, tower.trainable_variables), tower.trainable_variables)
        return {"loss": loss}  # the last tower's (Keras's loop needs an output)


def test_every_optimizer_matches_unwrapped():
    """A float32 model: scaling by 2^15 and back is exact, so kmix == the bare optimizer, for each.

    Clipping therefore sees unscaled gradients (a scaled norm would clip
    differently), and a skipped batch is left out as if it were not there
    (a schedule's step, every optimizer's slots and counters).
    """
    x, y = make_data(bad_rows=[13])
    runs = {}
    for wrapped in (False, True):
        opts = [wrap_like_float32(make()) if wrapped else make() for make in OPTIMIZERS.values()]
        model = Towers(opts)
        model.compile(steps_per_execution=2 if wrapped else 1)
        fit_without_the_bad_batch(model, x, y, wrapped, opts)
        runs[wrapped] = [tower.get_weights() for tower in model.towers]
    start = make_tower().get_weights()
    for name, bare, kmixed in zip(OPTIMIZERS, runs[False], runs[True]):
        assert not np.array_equal(kmixed[0], start[0]), name  # this tower was stepped
        for a, b in zip(bare, kmixed):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7, err_msg=name)


def test_counters_survive_save_and_load(tmp_path):
    model = make_model(policy="mixed_float16")
    opt = kmix.wrap(keras.optimizers.Adam(1e-2), hysteresis=2, growth_interval=3)
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    x, y = make_data(bad_rows=[3, 20])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    lopt = loaded.optimizer
    assert type(lopt) is kmix.LossScaleOptimizer
    assert lopt.get_config() == opt.get_config()
    for name in ("loss_scale", "skipped_steps", "good_steps", "hysteresis_left",
                 "overflow_counts", "min_scale_overflows", "iterations"):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(getattr(lopt, name)),
            keras.ops.convert_to_numpy(getattr(opt, name)),
            err_msg=name,
        )
    assert int(lopt.skipped_steps) == 2
    # A loaded model's variable paths lose the model's name prefix; the rows stay.
    report, loaded_report = opt.overflow_report(), lopt.overflow_report()
    assert [c for _, c in loaded_report] == [c for _, c in report] == [2]
    assert report[0][0].endswith(loaded_report[0][0])


def test_variable_paths_do_not_depend_on_who_builds():
    """Built by `build` (Keras's symbolic build, callbacks) or by the first `apply`: same paths."""
    paths = []
    for how in ("build", "apply"):
        keras.backend.clear_session(free_memory=False)  # the names restart; no gc pass
        model = make_model()
        opt = kmix.wrap(keras.optimizers.Adam(1e-3))
        if how == "build":
            opt.build(model.trainable_variables)
        else:
            opt.apply([np.zeros(v.shape, "float32") for v in model.trainable_variables], model.trainable_variables)
        paths.append([v.path for v in opt.variables])
    assert paths[0] == paths[1]
    assert "adam/sequential_dense_kernel_momentum" in paths[0]
