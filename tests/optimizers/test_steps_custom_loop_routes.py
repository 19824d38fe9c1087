"""Every custom-loop route trains like float32: TensorFlow's guide, keras.io's, kmix's README.

Each route is one step function written as its guide writes it, run with
`kmix.wrap(SGD)` and, as the reference, with the bare SGD on the same model,
data and initial weights, the route's loss-scale calls left out (so clipping
stays). The model (one `Dense`) is float32 and the scale a power of two (2^12, dynamic), so
multiplying and dividing by it is exact: the weights agree to float32
rounding, and a gradient divided twice (an update 4096 times too small) or
not divided (4096 times too large) is far outside the tolerance. SGD, not
Adam: Adam divides most of a constant factor out of its update. One batch
holds a NaN: kmix skips it, the reference leaves it out.

Modes: a `tf.function`, the same with `jit_compile=True`, and a 2-replica
`MirroredStrategy` over the logical CPUs of tests/conftest.py (each replica
half the batch; the reference runs under the same strategy). The reference for the first two is
the plain `tf.function`: XLA's fusions move float32 results by a few ulps, far inside the tolerance.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix

GLOBAL_BATCH, STEPS, BAD_STEP, CLIP, SCALE = 8, 6, 3, 0.5, 2.0**12
WARNING = "scale_loss in the same step"


def tf_guide(opt, tape, loss, variables):
    """TensorFlow's mixed-precision guide, verbatim: get_scaled_loss, get_unscaled_gradients, apply_gradients."""
    with tape:
        scaled_loss = opt.get_scaled_loss(loss())
    scaled_gradients = tape.gradient(scaled_loss, variables)
    gradients = opt.get_unscaled_gradients(scaled_gradients)
    opt.apply_gradients(zip(gradients, variables))


def tf_guide_apply(opt, tape, loss, variables):
    """The guide's loop with Keras 3's `apply` at the end."""
    with tape:
        scaled_loss = opt.get_scaled_loss(loss())
    opt.apply(opt.get_unscaled_gradients(tape.gradient(scaled_loss, variables)), variables)


def unscale_clip_apply(opt, tape, loss, variables):
    """torch's order (unscale_, clip_grad_norm_, step) without saying `scaled=False`."""
    with tape:
        scaled_loss = opt.scale_loss(loss())
    grads = opt.get_unscaled_gradients(tape.gradient(scaled_loss, variables))
    opt.apply(tf.clip_by_global_norm(grads, CLIP)[0], variables)


def readme(opt, tape, loss, variables):
    """kmix's README: scale_loss, get_unscaled_gradients, clip, apply(..., scaled=False)."""
    with tape:
        scaled_loss = opt.scale_loss(loss())
    grads = opt.get_unscaled_gradients(tape.gradient(scaled_loss, variables))
    opt.apply(tf.clip_by_global_norm(grads, CLIP)[0], variables, scaled=False)


def scale_loss_apply(opt, tape, loss, variables):
    """Keras 3's loss-scale loop: scale_loss, then apply the scaled gradients."""
    with tape:
        scaled_loss = opt.scale_loss(loss())
    opt.apply(tape.gradient(scaled_loss, variables), variables)


def keras_io_apply(opt, tape, loss, variables):
    """keras.io's Keras 3 guides (custom train_step, loop from scratch): no scaling, `apply`."""
    with tape:
        value = loss()
    opt.apply(tape.gradient(value, variables), variables)


def keras_io_apply_gradients(opt, tape, loss, variables):
    """keras.io's older guides, GANs and VAEs: no scaling, `apply_gradients`."""
    with tape:
        value = loss()
    opt.apply_gradients(zip(tape.gradient(value, variables), variables))


ROUTES = [tf_guide, tf_guide_apply, unscale_clip_apply, readme, scale_loss_apply, keras_io_apply,
          keras_io_apply_gradients]
UNSCALED_ROUTES = (keras_io_apply, keras_io_apply_gradients)  # no loss scaling: warned once
CLIPPED = (unscale_clip_apply, readme)


def float32_route(clip):
    """The reference: the route with its loss-scale calls left out."""

    def step(opt, tape, loss, variables):
        with tape:
            value = loss()
        grads = tape.gradient(value, variables)
        if clip:
            grads = tf.clip_by_global_norm(grads, CLIP)[0]
        opt.apply_gradients(zip(grads, variables))

    return step


def batches():
    rng = np.random.default_rng(7)
    out = []
    for step in range(STEPS):
        x = rng.normal(size=(GLOBAL_BATCH, 5)).astype("float32")
        y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0], [-1.0]], "float32")).astype("float32")
        if step == BAD_STEP:
            x[1, 2] = np.nan  # on replica 0's half under MirroredStrategy
        out.append((x, y))
    return out


_STRATEGY = []


def two_replica_strategy():
    """One strategy for the module, reducing without collectives.

    Collective keys restart with each `MirroredStrategy` and TensorFlow
    remembers each key's shape for the life of the process, so strategies
    made by other tests would clash with this one's (see tests/optimizers/test_allreduce.py).
    """
    if not _STRATEGY:
        cpus = tf.config.list_logical_devices("CPU")
        if len(cpus) < 2:
            pytest.skip("needs the two logical CPU devices that tests/conftest.py configures")
        _STRATEGY.append(tf.distribute.MirroredStrategy(
            [d.name for d in cpus[:2]], cross_device_ops=tf.distribute.ReductionToOneDevice()))
    return _STRATEGY[0]


def run(route, mode, wrapped):
    keras.utils.set_random_seed(0)
    strategy = two_replica_strategy() if mode == "mirrored" else tf.distribute.get_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])  # one trace a run: a small one
        opt = keras.optimizers.SGD(0.05)
        if wrapped:
            opt = kmix.wrap(opt, dynamic=True, initial_scale=SCALE, growth_interval=1000)
        opt.build(model.trainable_variables)
    variables = model.trainable_variables

    def step_fn(x, y):
        def loss():
            return tf.reduce_sum(tf.square(model(x, training=True) - y)) / GLOBAL_BATCH

        route(opt, tf.GradientTape(), loss, variables)

    if mode == "mirrored":
        step = tf.function(lambda x, y: strategy.run(step_fn, args=(x, y)))
    else:
        step = tf.function(step_fn, jit_compile=mode == "xla")
    for i, (x, y) in enumerate(batches()):
        if i == BAD_STEP and not wrapped:
            continue
        if mode == "mirrored":
            x, y = (strategy.experimental_distribute_values_from_function(
                lambda ctx, a=a: tf.constant(np.split(a, 2)[ctx.replica_id_in_sync_group])) for a in (x, y))
        step(x, y)
    return [keras.ops.convert_to_numpy(v) for v in variables], opt


_REFERENCES = {}


def reference(clip, mode):
    """The bare route's weights: under the strategy for "mirrored" (each replica clips its own half's
    gradients), else one `tf.function` for "graph" and "xla" alike (no XLA compile for the reference)."""
    mode = "mirrored" if mode == "mirrored" else "graph"
    if (clip, mode) not in _REFERENCES:
        _REFERENCES[clip, mode] = run(float32_route(clip), mode, wrapped=False)[0]
    return _REFERENCES[clip, mode]


@pytest.mark.parametrize("mode", ["graph", "xla", "mirrored"])
@pytest.mark.parametrize("route", ROUTES, ids=[r.__name__ for r in ROUTES])
def test_route_trains_like_float32(route, mode):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, opt = run(route, mode, wrapped=True)
    want = reference(route in CLIPPED, mode)
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    assert int(keras.ops.convert_to_numpy(opt.skipped_steps)) == 1
    assert int(keras.ops.convert_to_numpy(opt.iterations)) == STEPS - 1
    messages = [str(w.message) for w in caught if WARNING in str(w.message)]
    if route in UNSCALED_ROUTES:
        verb = "apply_gradients" if route is keras_io_apply_gradients else "apply"
        assert len(messages) == 1 and f"{verb}() received gradients" in messages[0]
        assert "not divided by the loss scale" in messages[0]
    else:
        assert messages == []


def test_tf_guide_under_mixed_float16_follows_float32():
    """The issue's loop: TensorFlow's guide, mixed_float16, SGD; the float16 run ends where float32 does."""
    results = {}
    for policy in ("float32", "mixed_float16"):
        keras.config.set_dtype_policy(policy)
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1, dtype="float32")])
        # Dynamic under mixed_float16, from a scale at which no step overflows (2^15 does once).
        opt = kmix.wrap(keras.optimizers.SGD(0.05), initial_scale=2.0**8)
        opt.build(model.trainable_variables)
        initial = [v.numpy() for v in model.trainable_variables]
        step = tf.function(lambda x, y: tf_guide(
            opt, tf.GradientTape(),
            lambda: tf.reduce_mean(tf.square(tf.cast(model(x, training=True), "float32") - y)),
            model.trainable_variables))
        for x, y in batches():
            if np.isfinite(x).all():
                step(x, y)
        results[policy] = [v.numpy() - w for v, w in zip(model.trainable_variables, initial)]
    assert opt.dynamic and float(opt.loss_scale) == 2.0**8 and int(opt.skipped_steps) == 0
    for a, b in zip(results["float32"], results["mixed_float16"]):
        # The change of every weight, to float16's rounding (an update divided twice would be 2^8 smaller).
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-3 * np.abs(a).max())


def eager_setup():
    var = keras.Variable(np.zeros(2, np.float32))
    opt = kmix.wrap(keras.optimizers.SGD(1.0), dynamic=True, initial_scale=4.0)
    opt.build([var])
    return var, opt


def test_eager_guide_loop_and_a_gradient_logged_but_not_used():
    """Eagerly the tensors get_unscaled_gradients returned are known by identity; what it was given stays scaled."""
    var, opt = eager_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tf.GradientTape() as tape:
            loss = opt.get_scaled_loss(tf.reduce_sum(var * [1.0, 2.0]))
        scaled = tape.gradient(loss, [var])
        opt.apply_gradients(zip(opt.get_unscaled_gradients(scaled), [var]))  # the guide, eagerly
        np.testing.assert_array_equal(var.numpy(), [-1.0, -2.0])
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(var * [1.0, 2.0]))
        scaled = tape.gradient(loss, [var])
        opt.get_unscaled_gradients(scaled)  # only to log the true gradients
        opt.apply(scaled, [var])  # the scaled ones: divided
    np.testing.assert_array_equal(var.numpy(), [-2.0, -4.0])


def test_eager_transformed_gradients_are_taken_as_unscaled_with_a_warning():
    var, opt = eager_setup()
    with tf.GradientTape() as tape:
        loss = opt.scale_loss(tf.reduce_sum(var * [3.0, 4.0]))
    grads = opt.get_unscaled_gradients(tape.gradient(loss, [var]))
    clipped, _ = tf.clip_by_global_norm(grads, 1.0)  # [0.6, 0.8]: no graph to trace it back
    with pytest.warns(UserWarning, match=r"cannot tell what they were computed from.*scaled=False"):
        opt.apply(clipped, [var])
    np.testing.assert_allclose(var.numpy(), [-0.6, -0.8], rtol=1e-6)


def test_graph_gradients_partly_unscaled_are_refused():
    var, opt = eager_setup()
    other = keras.Variable(np.zeros(1, np.float32))
    opt = kmix.wrap(keras.optimizers.SGD(1.0), dynamic=True, initial_scale=4.0)
    opt.build([var, other])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(var) + tf.reduce_sum(other))
        g_var, g_other = tape.gradient(loss, [var, other])
        opt.apply([opt.get_unscaled_gradients([g_var])[0], g_other], [var, other])

    with pytest.raises(ValueError, match="others were not"):
        step()


def test_graph_scaled_gradients_applied_after_logging_their_unscaled_norm():
    """In a tf.function: get_unscaled_gradients for a norm only; apply on the scaled ones divides them."""
    var, opt = eager_setup()
    norms = []

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(var * [1.0, 2.0]))
        scaled = tape.gradient(loss, [var])
        norm = tf.linalg.global_norm(opt.get_unscaled_gradients(scaled))
        opt.apply(tf.clip_by_global_norm(scaled, 1e9)[0], [var])  # computed from the scaled ones
        return norm

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norms.append(float(step()))
    np.testing.assert_array_equal(var.numpy(), [-1.0, -2.0])
    assert abs(norms[0] - 5.0**0.5) < 1e-6
