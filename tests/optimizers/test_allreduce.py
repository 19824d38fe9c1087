"""`allreduce_dtype`: gradients summed in float16 / bfloat16 over two replicas, checked on the sums.

Two replicas are `MirroredStrategy` over the two logical CPUs of tests/conftest.py;
two workers are tested in tests/distribute/test_multi_worker_fit.py.
"""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import keras
import kmix
from kmix.optimizers import allreduce
from tests.optimizers.test_loss_scale_distribution import build, replica_values
from tests.optimizers.test_loss_scale_distribution import two_replica_strategy as new_two_replica_strategy

GLOBAL_BATCH = 4  # two rows per replica
_STRATEGY = []


def two_replica_strategy():
    """One `MirroredStrategy` over two logical CPUs for this whole module (its keys: tests/conftest.py)."""
    if not _STRATEGY:
        _STRATEGY.append(new_two_replica_strategy())
    return _STRATEGY[0]


def linear_run(strategy, xs, make_optimizer, steps):
    """A custom loop on `sum(Dense(x)) / GLOBAL_BATCH`, whose gradients do not depend on the weights.

    `xs[r]` is replica r's batch. Returns (model, optimizer, [weights before the first step,
    weights after it]).
    """
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((xs[0].shape[1],)), keras.layers.Dense(2)])
        opt = make_optimizer()
        opt.build(model.trainable_variables)
    batch = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(xs[ctx.replica_id_in_sync_group])
    )

    def step_fn(x):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_sum(model(x)) / GLOBAL_BATCH)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    step = tf.function(lambda: strategy.run(step_fn, args=(batch,)))
    first = [model.get_weights()]
    for i in range(steps):
        step()
        if i == 0:
            first.append(model.get_weights())
    return model, opt, first


def local_gradients(xs, units=2):
    """Each replica's gradient of the kernel and the bias (float32, numpy), as `linear_run` computes them."""
    return [
        (np.repeat(x.sum(axis=0, keepdims=True).T, units, axis=1) / GLOBAL_BATCH,
         np.full((units,), x.shape[0] / GLOBAL_BATCH, np.float32))
        for x in xs
    ]


def assert_same_on_both_replicas(variables):
    for v in variables:
        a, b = replica_values(v)
        np.testing.assert_array_equal(a, b, err_msg=getattr(v, "path", v.name))


def test_two_replicas_match_the_float32_reduction_within_the_half_rounding():
    """float16 and bfloat16 sums against the float32 sums (one run shared), and the first step against numpy."""
    strategy, steps, lr = two_replica_strategy(), 5, 0.5
    rng = np.random.default_rng(0)
    xs = [(rng.normal(size=(2, 3)) * 1e-3).astype("float32") for _ in range(2)]
    runs = {}

    def make(name):
        return kmix.wrap(keras.optimizers.SGD(lr), allreduce_dtype=name, dynamic=True)  # scale 2^15

    for name in (None, "float16", "bfloat16"):
        model, opt, first = linear_run(strategy, xs, lambda: make(name), steps)
        assert_same_on_both_replicas(model.trainable_variables)
        assert int(opt.iterations.numpy()) == steps and int(opt.skipped_steps.numpy()) == 0
        runs[name] = (model.get_weights(), float(opt.loss_scale), first)
    w32, scale32, _ = runs[None]
    for dtype in ("float16", "bfloat16"):
        whalf, scale, (w0, w1) = runs[dtype]
        assert scale32 == scale == 2.0**15
        # The bound. Each replica's scaled gradient S*g (times float16's wire scale W, a power of
        # two) is rounded once to the half dtype (relative error <= u, u = 2^-11 for float16, 2^-8
        # for bfloat16; the values are far above the smallest normal) and the sum once more
        # (<= u * |sum|): the reduced gradient is off by at most 2u(|a| + |b|) after the exact
        # division by S * W. The gradients do not depend
        # on the weights, so these errors do not compound: after N SGD steps the weights differ by
        # at most N * lr * 2u(|a| + |b|), plus float32's own rounding of the N updates in each run.
        u = 2.0**-11 if dtype == "float16" else 2.0**-8
        magnitude = [np.abs(ga) + np.abs(gb) for ga, gb in zip(*local_gradients(xs))]
        for a, b, m in zip(w32, whalf, magnitude):
            bound = steps * lr * 2 * u * m * (1 + 1e-3) + 2 * steps * 2.0**-24 * np.abs(a).max()
            assert np.all(np.abs(b - a) <= bound), (dtype, np.abs(b - a).max(), bound.min())
        # The half path ran (different rounding), and the inner optimizer did not sum the sums again
        # (that would double every update, far outside the bound).
        assert any(not np.array_equal(a, b) for a, b in zip(w32, whalf)), dtype
        # The first step, exactly: numpy's rounding of S*W*a and S*W*b and of their sum in the half dtype,
        # W = 2^(14 - floor(log2(max|S*a| + max|S*b|))) per variable for float16, 1 for bfloat16.
        half = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
        for w, start, (ga, gb) in zip(w1, w0, zip(*local_gradients(xs))):
            s = np.float32(scale)
            bound = np.abs(ga * s).max() + np.abs(gb * s).max()
            wire = np.float32(2.0 ** (14 - np.floor(np.log2(bound)))) if dtype == "float16" else np.float32(1)
            reduced = (half(half(ga * s * wire) + half(gb * s * wire))).astype(np.float32) / (s * wire)
            np.testing.assert_array_equal(w, start - np.float32(lr) * reduced, err_msg=dtype)


def test_an_inf_on_one_replica_skips_on_both():
    strategy = two_replica_strategy()
    xs = [np.ones((2, 1), np.float32), np.array([[1.0], [np.inf]], np.float32)]
    for dtype in (None, "float16"):
        model, opt, _ = linear_run(
            strategy, xs,
            lambda: kmix.wrap(keras.optimizers.Adam(0.1), allreduce_dtype=dtype, dynamic=True, initial_scale=1.0,
                              min_scale=0.25),
            steps=1,
        )
        assert_same_on_both_replicas(model.trainable_variables + opt.variables)
        assert int(opt.iterations.numpy()) == 0 and int(opt.skipped_steps.numpy()) == 1
        assert float(opt.loss_scale) == 0.5  # backed off once
        assert opt.overflow_counts.numpy().tolist() == [1, 0]  # the kernel's sum; the bias's is 2/4 + 2/4
        for slot in opt.inner_optimizer.variables[2:]:  # Adam's moments: untouched
            assert not np.any(keras.ops.convert_to_numpy(slot))
        keras.utils.set_random_seed(0)
        fresh = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)])
        for w, w0 in zip(model.get_weights(), fresh.get_weights()):
            np.testing.assert_array_equal(w, w0)


def test_gradients_and_sums_above_65504_take_the_step_the_float32_reduce_takes():
    """Each replica's kernel gradient is 2 * 80000 / 4 = 40000 (times the scale): the wire scale keeps the sum finite."""
    strategy = two_replica_strategy()
    xs = [np.full((2, 1), 80000.0, np.float32)] * 2
    weights = {}
    for dtype in (None, "float16"):
        model, opt, _ = linear_run(
            strategy, xs, lambda: kmix.wrap(keras.optimizers.SGD(1e-6), allreduce_dtype=dtype, dynamic=True), steps=1
        )
        assert int(opt.iterations.numpy()) == 1 and int(opt.skipped_steps.numpy()) == 0
        assert float(opt.loss_scale) == 2.0**15
        weights[dtype] = model.get_weights()
    for a, b in zip(weights[None], weights["float16"]):
        np.testing.assert_allclose(b, a, rtol=2.0**-10)


def test_a_float32_output_layer_under_mixed_float16_loses_no_step():
    """The issue's run: the float32 head's scaled gradient is above 65504; float16 sums take every step float32 takes."""
    strategy = two_replica_strategy()
    rng = np.random.default_rng(2)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    results = {}
    for dtype in (None, "float16", "bfloat16"):
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        with strategy.scope():
            # Hidden activations near 50 (the bias): the head's kernel gradient, about 50 times the
            # error, is above 65504 at the scale 2^15, while the float16 layer's gradients stay finite.
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu", bias_initializer=
                                                                            keras.initializers.Constant(50.0)),
                                      keras.layers.Dense(1, dtype="float32", kernel_initializer=
                                                         keras.initializers.RandomNormal(stddev=0.01))])
            model.compile(optimizer=kmix.wrap(keras.optimizers.Adam(1e-2), allreduce_dtype=dtype), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        opt = model.optimizer
        results[dtype] = (model.get_weights(), int(opt.skipped_steps.numpy()), int(opt.iterations.numpy()))
        assert_same_on_both_replicas(model.trainable_variables)
    head_kernel = results[None][0][2]
    assert results[None][1:] == (0, 4)  # float32 sums: every step taken at 2^15...
    for dtype in ("float16", "bfloat16"):
        weights, skipped, iterations = results[dtype]
        assert (skipped, iterations) == (0, 4), dtype  # ...and so with half sums
        for a, b in zip(results[None][0], weights):
            np.testing.assert_allclose(np.float32(b), np.float32(a), rtol=1e-2, atol=1e-2 * np.abs(head_kernel).max())


def test_wire_scales_are_exact_powers_of_two_below_2_15():
    bounds = tf.constant([1.0, 3.0, 65504.0, 2.0**40, 1e-30, 0.0, np.inf, np.nan, 2.0**-140], tf.float32)
    got = allreduce.wire_scales(bounds).numpy()
    finite = np.isfinite(bounds.numpy())
    products = bounds.numpy()[:5] * got[:5]
    assert np.all((products >= 2.0**14) & (products < 2.0**15))
    assert np.all(np.log2(got) == np.round(np.log2(got)))  # powers of two
    assert got[5] == 2.0**120 and got[8] == 2.0**120  # zero and subnormal bounds: the cap
    assert got[6] == got[7] == 1.0 and not finite[6:8].any()  # inf / NaN reach the sums as they are


def test_accumulation_reduces_once_per_step_and_matches_float32(monkeypatch):
    strategy = two_replica_strategy()
    calls = tf.Variable(0, dtype=tf.int64, trainable=False)
    real = allreduce.all_reduce

    def counted(*args, **kwargs):
        calls.assign_add(1)  # runs only where the reduction runs (inside the end-of-window cond)
        return real(*args, **kwargs)

    monkeypatch.setattr(allreduce, "all_reduce", counted)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    x[13, 2] = np.nan  # replica 1's half of micro-batch 1: the window of micro-batches 0-1 is skipped
    results = {}
    for dtype in (None, "float16"):
        model = build(strategy, lambda: kmix.wrap(
            keras.optimizers.SGD(0.05), accumulation_steps=2, allreduce_dtype=dtype, initial_scale=2.0**8))
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        opt = model.optimizer
        results[dtype] = model.get_weights()
        assert (int(opt.iterations.numpy()), int(opt.skipped_steps.numpy())) == (1, 1)
        assert_same_on_both_replicas(model.trainable_variables)
    assert int(calls.numpy()) == 2 * 2  # two windows, two replicas: one reduction per window each
    for a, b in zip(results[None], results["float16"]):
        # mixed_float16's float32 reference differs by float16 rounding of O(1) gradients.
        np.testing.assert_allclose(np.float32(b), np.float32(a), rtol=3e-3, atol=3e-3)


@pytest.mark.parametrize("master_weights", [True, "kahan"])
def test_master_weights_and_kahan_compose(master_weights):
    """float16 parameters with float32 copies (float16 sums), bfloat16 ones with Kahan buffers (bfloat16 sums)."""
    strategy = two_replica_strategy()
    dtype = "float16" if master_weights is True else "bfloat16"
    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    results = {}
    for reduce_in in (None, dtype):
        keras.config.set_dtype_policy(dtype)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
            opt = kmix.wrap(kmix.optimizers.SGD(0.05), master_weights=master_weights, allreduce_dtype=reduce_in)
            model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert int(opt.iterations.numpy()) == 2 and opt.built
        assert_same_on_both_replicas(model.trainable_variables + opt.variables)
        results[reduce_in] = model.get_weights()
    for a, b in zip(results[None], results[dtype]):
        # The float16 / bfloat16 gradients were already in that dtype: only the sum rounds again.
        np.testing.assert_allclose(np.float32(b), np.float32(a), rtol=2e-2, atol=2e-2)


def test_no_strategy_and_one_replica_are_no_ops():
    xs = [np.random.default_rng(5).normal(size=(2, 3)).astype("float32")]
    for strategy in (tf.distribute.get_strategy(), tf.distribute.MirroredStrategy(["CPU:0"])):
        weights = [
            linear_run(strategy, xs, lambda: kmix.wrap(keras.optimizers.SGD(0.1), allreduce_dtype=d,
                                                         dynamic=True), 2)[0].get_weights()
            for d in (None, "float16")
        ]
        for a, b in zip(*weights):
            np.testing.assert_array_equal(a, b)


def test_config_round_trip_and_bad_values():
    for dtype in ("float16", "bfloat16", None):
        opt = kmix.LossScaleOptimizer(keras.optimizers.SGD(0.1), allreduce_dtype=dtype)
        assert opt.get_config()["allreduce_dtype"] == dtype
        again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
        assert type(again) is kmix.LossScaleOptimizer and again.allreduce_dtype == dtype
        assert again.get_config() == opt.get_config()
    assert kmix.LossScaleOptimizer(keras.optimizers.SGD(), allreduce_dtype=tf.bfloat16).allreduce_dtype == "bfloat16"
    # The float16 sums keep their range with their own wire scale: no loss scale needed for them.
    assert not kmix.wrap("sgd", allreduce_dtype="float16").dynamic
    assert not kmix.wrap("sgd", allreduce_dtype="bfloat16").dynamic
    for bad in ("fp16", "float32", 16, True):
        for make in (kmix.wrap, kmix.LossScaleOptimizer):
            with pytest.raises(ValueError) as info:
                make(keras.optimizers.SGD(), allreduce_dtype=bad)
            message = str(info.value)
            assert f"allreduce_dtype={bad!r}" in message and "'float16', 'bfloat16' or None" in message
