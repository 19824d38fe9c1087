"""Checks that only mean something on a GPU: tensor-core routes under XLA, its memory, the demo there.

Every test here is marked `gpu`: skipped where TensorFlow sees no GPU (tests/conftest.py),
selected on a GPU machine with `python -m pytest -m gpu` (which `python -m kmix bench gpu`
runs). Each compares against a reference computed another way: a float32 model, float64 NumPy,
`kmix.memory_report`'s count of the variables.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix import demo
from kmix.benchmarks import memory, train_rounds
from kmix.benchmarks.routes import Route

pytestmark = pytest.mark.gpu

SIZE = {"layers": 2, "d_model": 128, "heads": 4, "seq": 64, "vocab": 512, "batch": 8}


@pytest.fixture(scope="module")
def float32_loss():
    """The float32 route's loss after 20 XLA steps: the reference of every half route."""
    reference = Route("gpt", SIZE, "float32", "keras", jit_compile=True)
    reference.train(20)
    keras.config.set_dtype_policy("float32")
    return reference.loss


@pytest.mark.parametrize("policy", ["O1-float16", "O1-bfloat16", "O2-float16", "O2-bfloat16", "mixed_float16"])
def test_every_route_trains_like_float32_under_xla(policy, float32_loss):
    """Same seed, same batch, same steps: the half route's loss tracks float32's (tensor cores, XLA)."""
    stack = "keras" if policy.startswith("mixed") else "recommended"  # "recommended": autocast + wrap
    route = Route("gpt", SIZE, policy, stack, jit_compile=True)
    route.train(20)
    assert route.jit_compile and math.isfinite(route.loss)
    half = kmix.Policy(policy).compute_dtype
    computed = {layer.compute_dtype for layer in route.model.layers if isinstance(layer, keras.layers.Dense)}
    assert half in computed
    assert route.loss == pytest.approx(float32_loss, rel=0.05)


@pytest.mark.parametrize("tf32", [True, False])
def test_float32_with_and_without_tf32_matches_float64(tf32):
    """TF32 rounds matmul inputs to 10 mantissa bits: within 1e-2 of float64, exact-ish without it."""
    previous = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(tf32)
    try:
        rng = np.random.default_rng(0)
        a, b = rng.normal(size=(256, 512)), rng.normal(size=(512, 256))
        got = tf.function(lambda x, y: x @ y, jit_compile=True)(a.astype("float32"), b.astype("float32"))
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(previous)
    error = np.abs(got.numpy() - a @ b).max() / np.abs(a @ b).max()
    assert error < (1e-2 if tf32 else 1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_masked_softmax_under_xla_on_the_gpu(dtype):
    """A fully masked row gives zeros and finite gradients; the rest matches float64 NumPy."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 8)) * 30
    mask = np.ones((4, 8), bool)
    mask[1] = False
    mask[2, 5:] = False

    @tf.function(jit_compile=True)
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = kmix.ops.masked_softmax(x, mask=mask, dtype="float32")
            loss = tf.reduce_sum(y * tf.range(8, dtype="float32"))
        return y, tape.gradient(loss, x)

    x = tf.constant(logits, dtype=dtype)
    probs, grad = run(x)
    assert np.isfinite(tf.cast(grad, "float32").numpy()).all()
    kept = np.where(mask, tf.cast(x, "float64").numpy(), -np.inf)
    expected = np.exp(kept - kept.max(axis=1, keepdims=True).clip(-1e300))
    with np.errstate(invalid="ignore"):  # the fully masked row: 0 / 0, made 0 below
        expected = np.nan_to_num(expected / expected.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(probs.numpy(), expected, atol=1e-5)
    assert (probs.numpy()[1] == 0).all()


def test_resident_memory_is_what_memory_report_counts_and_o1_peaks_lower():
    """The GPU allocator sees every tensor: between steps, about what `memory_report` counts; O1's
    half activations peak below float32's at a size where activations dominate."""
    size = {"layers": 2, "d_model": 256, "heads": 4, "seq": 512, "vocab": 512, "batch": 16}
    configs = {c[0]: c for c in memory.CONFIGS}
    results = {name: memory.measure(configs[name], size, steps=1, jit_compile=True)
               for name in ("float32", "O1", "O2 masters")}
    keras.config.set_dtype_policy("float32")
    for r in results.values():
        assert r["state_bytes"] == pytest.approx(r["report_state_bytes"], rel=0.15), r
        assert r["peak_bytes"] > r["state_bytes"] and math.isfinite(r["loss"])
    assert results["O1"]["peak_bytes"] < results["float32"]["peak_bytes"]


def test_bench_train_measures_peak_memory_and_the_largest_batch():
    size = {**SIZE, "layers": 1, "d_model": 32, "heads": 2, "seq": 16, "vocab": 64, "batch": 2}
    alone = train_rounds.measure(("float32", "keras", True), size, steps=2, rounds=1)
    assert alone["peak_bytes"] > 0
    assert train_rounds.largest_batch("float32", "keras", size, 2, 8) == (8, True)  # a tiny model fits


def test_demo_on_the_gpu(tmp_path):
    """The hand-written -1e9 mask is NaN from step 1 in float16; kmix's run ends where float32's does."""
    try:
        results = demo.main(["--steps", "40", "--quiet", "--out", str(tmp_path)])
    finally:
        keras.config.set_dtype_policy("float32")
    assert results["naive"]["first_nan_step"] == 1
    assert results["kmix"]["first_nan_step"] is None
    f32, ours = results["float32"], results["kmix"]
    assert abs(ours["final_loss"] - f32["final_loss"]) <= 0.1 * f32["final_loss"] + 0.02  # as tests/test_demo.py
    assert abs(ours["accuracy"] - f32["accuracy"]) <= 0.05
