"""`master_weights="kahan"`: half parameters plus a half compensation buffer.

The reference is a numpy loop in the same dtypes (ml_dtypes' bfloat16) that
does what Keras's SGD and the compensated sum do, step by step.
"""

import os
import tempfile

import keras
import ml_dtypes
import numpy as np
import pytest

import kmix
from kmix.policy import policy_scope

BF16 = ml_dtypes.bfloat16


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


def reference(lr, steps, kahan, start=1.0, comp=0.0):
    """Keras's SGD step in bfloat16 (lr and gradient cast, product rounded), then the sum."""
    w, c = BF16(start), BF16(comp)
    delta = BF16(np.float32(BF16(lr)) * np.float32(BF16(1.0)))
    for _ in range(steps):
        if not kahan:
            w = BF16(np.float32(w) - np.float32(delta))
            continue
        y = np.float32(-np.float32(delta)) + np.float32(c)
        new = BF16(np.float32(w) + y)
        c = BF16(y - (np.float32(new) - np.float32(w)))
        w = new
    return float(w), float(c)


@pytest.mark.parametrize("jit_compile", [True])  # tf.function: the resume test below
def test_a_thousand_tiny_updates_add_up(jit_compile):
    lr, steps = 1e-5, 1000
    results = {}
    for mw in ("kahan", False):
        model = build()
        opt = kmix.wrap(keras.optimizers.SGD(lr), master_weights=mw)
        model.compile(optimizer=opt, loss="mae", jit_compile=jit_compile, steps_per_execution=100)
        fit(model, steps)
        results[mw] = (weight(model), opt)
    w, opt = results["kahan"]
    step = 2.0**-8  # bfloat16's spacing just below 1
    assert abs(w - 0.99) <= step
    assert results[False][0] == 1.0  # plain bfloat16: every update rounds away
    # The parameter plus its buffer hold the exact sum; both match the loop by hand.
    assert (w, compensation(opt)) == reference(lr, steps, kahan=True)
    # The buffer is bfloat16 too: it rounds each update it absorbs to its own
    # spacing (2^-18 near 1e-3), so parameter + buffer keep ~90% of the 0.01 the
    # updates add up to, where plain bfloat16 keeps none of it.
    moved = steps * float(BF16(lr))
    assert abs(w + compensation(opt) - (1 - moved)) < 0.15 * moved


def test_buffers_are_half_optimizer_variables_and_memory_report_counts_them():
    model = build()
    with pytest.raises(ValueError, match="beta_2"):  # 0.999 is 1.0 in bfloat16: Adam would not move
        kmix.wrap(keras.optimizers.Adam(1e-3), master_weights="kahan").build(model.trainable_variables)
    model.compile(optimizer=kmix.wrap(keras.optimizers.Adam(1e-3), master_weights="kahan"), loss="mae")
    with pytest.raises(ValueError, match="beta_2"):  # also when `fit` builds it while tracing
        fit(model, 1)
    opt = kmix.wrap(keras.optimizers.Adam(1e-3, beta_2=0.99), master_weights="kahan")
    opt.build(model.trainable_variables)
    (c,) = [v for v in opt.variables if "kahan" in v.path]
    assert c.dtype == "bfloat16" and tuple(c.shape) == (1, 1)
    assert not any("master" in v.path for v in opt.variables)
    # Adam's slots live on the bfloat16 parameter itself.
    assert {v.dtype for v in opt.inner_optimizer.variables if len(v.shape)} == {"bfloat16"}
    report = kmix.memory_report(8e9, kmix.Policy("O2", half="bfloat16"), opt)["O2-bfloat16"]
    masters = kmix.memory_report(8e9, kmix.Policy("O2", half="bfloat16"), "adam")["O2-bfloat16"]
    assert report["master_weights"] == 2 * 8e9 and report["optimizer_slots"] == 2 * 2 * 8e9
    assert masters["master_weights"] == 4 * 8e9 and masters["optimizer_slots"] == 2 * 4 * 8e9
    assert report["total"] == 80e9 and masters["total"] == 128e9
    with pytest.raises(ValueError, match="master_weights"):
        kmix.wrap("sgd", master_weights="kahn")


def test_saved_restored_and_resumed_exactly():
    lr = 1e-5
    model = build()
    model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(lr), master_weights="kahan"), loss="mae",
                  steps_per_execution=100)
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
    assert (weight(loaded), compensation(loaded.optimizer)) == reference(lr, 600, kahan=True)


def test_a_small_model_trains_like_float32_masters():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * np.sin(3 * x[:, :1])).astype(np.float32)
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
            history = model.fit(x, y, batch_size=32, epochs=12, shuffle=False, verbose=0)
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
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
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
        np.testing.assert_allclose(wa + ca, wb + cb, atol=2.0**-12)


def two_replicas():
    """MirroredStrategy over the two logical CPUs of tests/conftest.py.

    Reduction to one device, not collectives: TensorFlow numbers the collective
    instances of every MirroredStrategy in a process alike, and two strategies
    whose reductions have different shapes then abort each other.
    """
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
