"""A skipped step changes nothing: batch-norm statistics included, bit for bit.

The reference is the same training without the bad batch. The bad batch's
activations overflow float16 in the forward pass (inputs of 1e5 through a
Dense of ones): batch norm's moving statistics would take inf, the gradients
are non-finite and the optimizer skips the step. The scale is fixed (16), so
the skip changes no scale and both runs take exactly the same applied steps.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix

BAD = 2  # the index of the bad batch


def batches(with_bad):
    rng = np.random.default_rng(0)
    out = []
    for i in range(5):
        x = rng.normal(size=(8, 4)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        if i == BAD:
            if not with_bad:
                continue
            x = np.full_like(x, 1e5)  # 4e5 after the first Dense: inf in float16
        out.append((x, y))
    return out


def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(4, kernel_initializer="ones"),
        keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Dense(1),
    ])


def make_optimizer(restore_on_skip=True):
    return kmix.wrap(keras.optimizers.Adam(1e-2), dynamic=False, initial_scale=16.0,
                     restore_on_skip=restore_on_skip)


def run(route, data_sets=(False, True), restore_on_skip=True):
    """Trains one model on each data set in turn (False: without the bad batch, True: with it), from one start.

    Every model and optimizer variable is put back to its starting value between
    the runs, so that the step is traced once. Returns, for each run,
    (weights, inner optimizer's variables, skipped steps, iterations), and the optimizer.
    """
    keras.config.set_dtype_policy("mixed_float16")
    strategy = tf.distribute.get_strategy()
    if route == "mirrored":
        cpus = tf.config.list_logical_devices("CPU")
        # No collectives: their keys restart with each strategy, and another test's strategy
        # in this process may have used them for other shapes.
        strategy = tf.distribute.MirroredStrategy([d.name for d in cpus[:2]],
                                                   cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        model = build()
        opt = make_optimizer(restore_on_skip)
        opt.build(model.trainable_variables)  # its variables exist now: their starting values can be kept
    variables = list(model.variables) + list(opt.variables)
    start = [np.array(keras.ops.convert_to_numpy(v)) for v in variables]
    if route == "custom_loop":
        opt.track(model)
        loss_fn = keras.losses.MeanSquaredError()

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = opt.scale_loss(loss_fn(y, model(x, training=True)))
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    else:
        with strategy.scope():
            model.compile(optimizer=opt, loss="mse", jit_compile=route == "xla")
    results = []
    for with_bad in data_sets:
        with strategy.scope():
            for v, value in zip(variables, start):
                v.assign(value)
        data = batches(with_bad)
        if route == "custom_loop":
            for x, y in data:
                step(tf.constant(x), tf.constant(y))
        else:
            x = np.concatenate([b[0] for b in data])
            y = np.concatenate([b[1] for b in data])
            model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        state = [np.asarray(w) for w in model.get_weights()]  # kernels, biases, BN gamma/beta/mean/var
        slots = [np.asarray(keras.ops.convert_to_numpy(v)) for v in opt.inner_optimizer.variables]
        results.append((state, slots, count(opt.skipped_steps), count(opt.iterations)))
    return results, opt


def count(variable):
    return int(keras.ops.convert_to_numpy(variable.value))


@pytest.mark.parametrize("route", ["fit", "xla", "custom_loop", "mirrored"])
def test_skipped_step_is_bit_identical_to_no_step(route):
    (ref_state, ref_slots, ref_skipped, ref_iterations), (state, slots, skipped, iterations) = run(route)[0]
    assert skipped == 1 and ref_skipped == 0
    assert iterations == ref_iterations == 4
    assert len(state) == 8  # the moving mean and variance are among them
    for a, b in zip(ref_state + ref_slots, state + slots):
        np.testing.assert_array_equal(b, a)


def test_without_restore_the_skipped_forward_pass_leaves_inf_statistics():
    """`restore_on_skip=False`, Keras's behaviour: the weights are safe, the statistics are not."""
    ((state, _, skipped, _),), opt = run("fit", data_sets=(True,), restore_on_skip=False)
    assert skipped == 1
    moving_mean, moving_var = state[4], state[5]
    assert not np.isfinite(np.concatenate([moving_mean, moving_var])).all()
    assert opt.get_config()["restore_on_skip"] is False
    assert kmix.LossScaleOptimizer.from_config(opt.get_config()).restore_on_skip is False


def test_a_skipped_step_after_a_reload_goes_back_to_the_loaded_statistics(tmp_path):
    """Weights loaded between steps (load_weights with a built optimizer) are what a skipped step keeps."""
    keras.config.set_dtype_policy("mixed_float16")
    model = build()
    opt = make_optimizer()
    model.compile(optimizer=opt, loss="mse")
    good = batches(with_bad=False)
    model.fit(good[0][0], good[0][1], batch_size=8, verbose=0)
    model.save_weights(str(tmp_path / "w.weights.h5"))
    saved = [np.array(w) for w in model.get_weights()]
    model.fit(good[1][0], good[1][1], batch_size=8, verbose=0)  # moves the statistics on
    model.load_weights(str(tmp_path / "w.weights.h5"))  # ... and back
    bad = np.full((8, 4), 1e5, np.float32)
    model.fit(bad, np.zeros((8, 1), np.float32), batch_size=8, verbose=0)
    assert int(opt.skipped_steps) == 1
    for a, b in zip(saved, model.get_weights()):
        np.testing.assert_array_equal(b, a)  # the moving mean and variance too


def test_only_what_the_forward_pass_writes_is_restored():
    """A frozen base (here: a frozen Dense and a frozen BatchNormalization in inference) costs nothing."""
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    frozen = keras.layers.Dense(4)
    frozen.trainable = False
    model = keras.Sequential([keras.Input((4,)), frozen, keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.1), keras.layers.Dense(1)])
    opt = make_optimizer()
    model.compile(optimizer=opt, loss="mse")
    x, y = batches(with_bad=False)[0]
    model.fit(x, y, batch_size=8, verbose=0)
    # Written: the moving mean and variance and the dropout seed; not the frozen kernel and bias.
    assert len(model.non_trainable_variables) == 5
    assert opt._written_in_last_trace == 3


def test_track_restricts_to_a_model_and_rejects_other_things():
    """Two optimizers in one step (a GAN): each puts back only its own model's forward writes."""
    keras.config.set_dtype_policy("mixed_float16")
    model = build()
    other = build()
    opt = make_optimizer().track(model)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            other(x, training=True)  # writes `other`'s statistics: not this optimizer's to restore
            loss = opt.scale_loss(loss_fn(y, model(x, training=True)))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    x, y = batches(with_bad=False)[0]
    step(tf.constant(x), tf.constant(y))
    assert opt._written_in_last_trace == 2
    with pytest.raises(TypeError, match=r"`track` takes a keras.Model.*Received: 'model'"):
        opt.track("model")
