"""`master_weights="kahan"`: half parameters, a 2-byte remainder, float32 arithmetic.

References: the same optimizer on a float32 variable (Keras's own update),
and a NumPy loop of the compensated sum (ml_dtypes' bfloat16).
"""

import os
import tempfile

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix.policy import policy_scope

BF16 = ml_dtypes.bfloat16
NP_HALF = {"bfloat16": BF16, "float16": np.float16}
MANTISSA = {"bfloat16": 7, "float16": 10}


def build():
    """One bfloat16 parameter w = 1.0; `mae` on y = 0 with x = 1 gives the gradient 1."""
    inputs = keras.Input((1,))
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", dtype="bfloat16", name="w")
    return keras.Model(inputs, dense(inputs))


def fit(model, steps):
    xs = np.ones((steps, 1), np.float32)
    model.fit(xs, np.zeros_like(xs), batch_size=1, epochs=1, shuffle=False, verbose=0)


def compensation(opt):
    (c,) = [v for v in opt.variables if "kahan" in v.path]
    return float(keras.ops.convert_to_numpy(c).reshape(-1)[0])


def weight(model):
    return float(keras.ops.convert_to_numpy(model.get_layer("w").kernel)[0, 0])


def spacing(x, dtype="bfloat16"):
    """The half dtype's spacing in x's binade (what kmix.optimizers.kahan calls `unit`)."""
    x = np.abs(np.asarray(x, np.float64))
    return np.maximum(2.0 ** (np.floor(np.log2(np.maximum(x, 2.0**-126))) - MANTISSA[dtype]), 2.0**-126)


def reference(lr, steps, start=1.0, comp=0.0):
    """Keras's SGD update in float32 (-lr * 1), added to bfloat16 with a float16 remainder in spacings."""
    w, c = BF16(start), np.float16(comp)
    update = -np.float32(lr)
    for _ in range(steps):
        old = np.float32(w)
        y = np.float32(update + np.float32(c) * np.float32(spacing(old)))
        w = BF16(old + y)
        c = np.float16(np.float32(y - (np.float32(w) - old)) / np.float32(spacing(np.float32(w))))
    return float(w), float(c)


def test_a_thousand_tiny_updates_add_up():
    lr, steps = 1e-5, 1000
    results = {}
    for mw in ("kahan", False):
        model = build()
        opt = kmix.wrap(keras.optimizers.SGD(lr), master_weights=mw)
        model.compile(optimizer=opt, loss="mae", jit_compile=True, steps_per_execution=100)
        opt.build(model.trainable_variables)  # here, not inside fit's first trace (which traces it twice then)
        fit(model, steps)
        results[mw] = (weight(model), opt)
    w, opt = results["kahan"]
    assert results[False][0] == 1.0  # plain bfloat16: every update rounds away
    # The parameter and its buffer match the loop by hand, bit for bit...
    assert (w, compensation(opt)) == reference(lr, steps)
    # ...and together hold float32's sum (0.99) to a tenth of one bfloat16 spacing (the float16
    # remainder keeps 11 bits of a spacing; each update here is 1/400 of one).
    exact = float(np.float32(1.0) - np.float32(steps) * np.float32(lr))
    assert abs(w - 0.99) <= 2.0**-8
    assert abs(w + compensation(opt) * spacing(w) - exact) < 0.1 * 2.0**-8


# The rates move each weight (between 1 and 2, where one bfloat16 spacing is 2^-7) by 5 to 50
# spacings in the 2000 steps.
TRACKED = {
    "sgd": lambda: keras.optimizers.SGD(1e-4),
    "sgd-momentum": lambda: keras.optimizers.SGD(1e-5, momentum=0.9),
    "sgd-nesterov": lambda: keras.optimizers.SGD(1e-5, momentum=0.9, nesterov=True),
    "kmix-sgd": lambda: kmix.optimizers.SGD(1e-5, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-4),  # beta_2=0.999: 1.0 in bfloat16
    "adamw": lambda: keras.optimizers.AdamW(1e-4),  # weight_decay=0.004, decoupled
    "amsgrad": lambda: keras.optimizers.Adam(1e-4, amsgrad=True),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-4),
    "rmsprop-centered-momentum": lambda: keras.optimizers.RMSprop(1e-5, momentum=0.9, centered=True),
    "adagrad": lambda: keras.optimizers.Adagrad(1e-2),
    "adamax": lambda: keras.optimizers.Adamax(3e-4),
    "lion": lambda: keras.optimizers.Lion(3e-5),
    "lamb": lambda: keras.optimizers.Lamb(1e-4),
    "adadelta": lambda: keras.optimizers.Adadelta(0.1),
}
# By default one of each family (the others, same mechanism, with KMIX_KAHAN_ALL=1).
DEFAULT = ("sgd-momentum", "kmix-sgd", "adam", "adamw", "rmsprop", "adagrad", "lion", "lamb", "adadelta")
CASES = [(n, "bfloat16") for n in TRACKED if n in DEFAULT or os.environ.get("KMIX_KAHAN_ALL") == "1"]
CASES += [("adam", "float16")]
STEPS = 2000


def problem(dtype):
    """The start (4, 8) and 64 gradients, seeded, representable in `dtype`."""
    rng = np.random.default_rng(0)
    start = (1.5 + rng.uniform(-0.4, 0.4, (4, 8))).astype(NP_HALF[dtype]).astype(np.float32)
    grads = (rng.normal(size=(64, 4, 8)) + 0.3).astype(NP_HALF[dtype]).astype(np.float32)
    grads[:, 0] = 1.0  # the first row takes a constant gradient (where slots kept half stall)
    return start, grads


def run(runs, steps, jit_compile=False):
    """Per `(make, dtype, master_weights, start, grads)`: `steps` updates of a (4, 8) kernel from `start`,
    gradient `grads[t % len(grads)]`; the end values. The runs step side by side in one traced loop: only
    bare Keras optimizers share one (kmix reads what else the traced step writes, as its forward pass)."""
    kernels = []
    for make, dtype, master_weights, start, grads in runs:
        variable = keras.Variable(start, dtype=dtype, name="kernel")
        opt = make() if master_weights is None else kmix.wrap(make(), master_weights=master_weights)
        opt.build([variable])
        kernels.append((variable, opt, tf.constant(grads, dtype)))

    def step(t):
        for variable, opt, grads in kernels:
            opt.apply([grads[t % grads.shape[0]]], [variable])
        return (t + 1,)

    # A while loop written out: AutoGraph would convert kmix's code and wrap every call (tests/optimizers/
    # test_steps_custom_loop_routes.py runs kmix under it); Keras's `fit` does not convert its step either.
    tf.function(lambda: tf.while_loop(lambda t: t < steps, step, (tf.constant(0),)),
                jit_compile=jit_compile, autograph=False)()
    return [keras.ops.convert_to_numpy(variable).astype(np.float64) for variable, _, _ in kernels]


@pytest.fixture(scope="module")
def float32_runs():
    """Every case's reference, Keras's own update on a float32 kernel: one traced loop for them all."""
    runs = [(TRACKED[name], "float32", None, *problem(dtype)) for name, dtype in CASES]
    return dict(zip(CASES, run(runs, STEPS)))


@pytest.mark.parametrize("name,dtype", CASES)
def test_tracks_the_float32_run_within_one_and_a_half_spacings(name, dtype, float32_runs):
    """2000 small steps of a seeded or constant gradient (representable in `dtype`): the half weights end where
    float32's do, to 1.5 of the half dtype's spacings (round to nearest alone is 0.5)."""
    start, grads = problem(dtype)
    jit = name == "adam" and dtype == "bfloat16"  # under XLA once
    reference = float32_runs[name, dtype]
    (kahan,) = run([(TRACKED[name], dtype, "kahan", start, grads)], STEPS, jit_compile=jit)
    (plain,) = run([(TRACKED[name], dtype, False, start, grads)], STEPS)
    assert np.abs(reference - start).max() > 4 * spacing(1.0, dtype)  # the weights moved
    off = np.abs(kahan - reference) / spacing(reference, dtype)
    assert off.max() <= 1.5, (name, off.max())
    # Without compensation the same steps drift (or stall) far beyond that.
    assert (np.abs(plain - reference) / spacing(reference, dtype)).max() > 2, name


def test_slots_are_float32_buffers_float16_and_memory_report_counts_them():
    model = build()
    opt = kmix.wrap(keras.optimizers.Adam(1e-3), master_weights="kahan")  # beta_2=0.999 runs
    opt.build(model.trainable_variables)
    (c,) = [v for v in opt.variables if "kahan" in v.path]
    assert c.dtype == "float16" and tuple(c.shape) == (1, 1)
    assert not any("master" in v.path for v in opt.variables)
    # Adam's slots are float32, on the bfloat16 parameter's shape.
    assert {v.dtype for v in opt.inner_optimizer.variables if len(v.shape)} == {"float32"}
    report = kmix.memory_report(8e9, kmix.Policy("O2", half="bfloat16"), opt)["O2-bfloat16"]
    masters = kmix.memory_report(8e9, kmix.Policy("O2", half="bfloat16"), "adam")["O2-bfloat16"]
    # Measured another way: the bytes of this optimizer's own variables, per parameter.
    n = 1
    buffer_bytes = sum(v.numpy().nbytes for v in opt.variables if "kahan" in v.path) / n
    slot_bytes = sum(np.prod(v.shape) * 4 for v in opt.inner_optimizer.variables if len(v.shape)) / n
    assert report["master_weights"] == buffer_bytes * 8e9 == 2 * 8e9
    assert report["optimizer_slots"] == slot_bytes * 8e9 == 2 * 4 * 8e9
    assert masters["master_weights"] == 4 * 8e9 and masters["optimizer_slots"] == 2 * 4 * 8e9
    assert report["total"] == 112e9 and masters["total"] == 128e9
    with pytest.raises(ValueError, match="master_weights"):
        kmix.wrap("sgd", master_weights="kahn")


class MyAdam(keras.optimizers.Adam):
    pass


@pytest.mark.parametrize("inner", [keras.optimizers.Nadam(), keras.optimizers.Adafactor(), MyAdam(),
                                   keras.optimizers.Adam(use_ema=True)], ids=["nadam", "adafactor", "subclass", "ema"])
def test_optimizers_it_cannot_run_in_float32_are_refused_at_wrap(inner):
    with pytest.raises(ValueError, match=type(inner).__name__):
        kmix.wrap(inner, master_weights="kahan")


def test_a_built_inner_optimizer_is_refused():
    model = build()
    inner = keras.optimizers.Adam()
    inner.build(model.trainable_variables)  # bfloat16 slots already
    with pytest.raises(ValueError, match="not built"):
        kmix.wrap(inner, master_weights="kahan").build(model.trainable_variables)


def test_saved_restored_and_resumed_exactly():
    lr = 1e-5
    model = build()
    model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(lr), master_weights="kahan"), loss="mae",
                  steps_per_execution=100)
    model.optimizer.build(model.trainable_variables)
    fit(model, 300)
    saved = (weight(model), compensation(model.optimizer))
    assert saved[1] != 0.0  # there is something to restore
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
    assert loaded.optimizer.master_weights == "kahan"
    assert (weight(loaded), compensation(loaded.optimizer)) == saved
    fit(loaded, 300)
    assert (weight(loaded), compensation(loaded.optimizer)) == reference(lr, 600)


def test_a_small_model_trains_like_float32_masters():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * np.sin(3 * x[:, :1])).astype(np.float32)
    # The same 8 batches of 32 each epoch, in order; batched once here (an iterator over NumPy
    # arrays costs about twice the CPU of this small model's 12 epochs).
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    losses = {}
    for mw in ("float32", True, "kahan"):
        level = "float32" if mw == "float32" else kmix.Policy("O2", half="bfloat16")
        with policy_scope(level):
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                                      keras.layers.Dense(1)])
            inner = keras.optimizers.SGD(3e-3, momentum=0.9)
            optimizer = inner if mw == "float32" else kmix.wrap(inner, master_weights=mw)
            model.compile(optimizer=optimizer, loss="mse", steps_per_execution=8)
            optimizer.build(model.trainable_variables)
            history = model.fit(data, epochs=12, shuffle=False, verbose=0)
        losses[mw] = history.history["loss"][-1]
    # The reference: the float32 model with the bare optimizer, the same 96 steps (0.049 here,
    # from 5.1; bfloat16 with float32 masters 0.037). Within bfloat16's noise of it...
    assert losses[True] < 1.5 * losses["float32"], losses
    # ...and the Kahan run within noise of the float32-master run.
    assert abs(losses["kahan"] - losses[True]) < 0.15 * losses[True], losses


def test_mirrored_strategy_updates_like_one_device():
    """Two replicas, one global batch: the same weights and buffers as without a strategy."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True).astype(np.float32)
    results = []
    for strategy in (tf.distribute.get_strategy(), two_replicas()):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, dtype="bfloat16", name="w")])
            opt = kmix.wrap(keras.optimizers.SGD(1e-3), master_weights="kahan")
            model.compile(optimizer=opt, loss="mse")
            opt.build(model.trainable_variables)  # as fit builds it under the strategy
        # Two epochs' 8 steps as one epoch over the data twice (each epoch under the strategy makes its own iterator).
        model.fit(np.concatenate([x, x]), np.concatenate([y, y]), batch_size=8, epochs=1, shuffle=False, verbose=0)
        buffers = [keras.ops.convert_to_numpy(v).astype(np.float32) for v in opt.variables if "kahan" in v.path]
        results.append(([w.astype(np.float32) for w in model.get_weights()], buffers))
    (w1, c1), (w2, c2) = results
    assert len(c1) == len(c2) == 2 and any(np.any(c != 0) for c in c1)
    # The replicas' gradients are summed in another order, so the float32 update can differ in
    # its last bits, and a parameter near a rounding boundary can then round to the neighbouring
    # bfloat16 value, the buffer holding the difference (seen on a CPU without AVX-512). Each
    # parameter is at most one bfloat16 value away; what parameter + buffer represent agrees to
    # well under one bfloat16 step.
    for a, b in zip(w1, w2):
        steps = a.astype(BF16).view(np.int16).astype(int) - b.astype(BF16).view(np.int16)
        assert np.abs(steps).max() <= 1, (a, b)
    for wa, ca, wb, cb in zip(w1, c1, w2, c2):
        np.testing.assert_allclose(wa + ca * spacing(wa), wb + cb * spacing(wb), atol=2.0**-12)


def two_replicas():
    """MirroredStrategy over the two logical CPUs of tests/conftest.py.

    Reduction to one device, not collectives: TensorFlow numbers the collective
    instances of every MirroredStrategy in a process alike, and two strategies
    whose reductions have different shapes then abort each other.
    """
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
