"""Checks that only mean something on a GPU: tensor cores, XLA, memory and placement there.

Every test here is marked `gpu`: skipped where TensorFlow sees no GPU (tests/conftest.py),
selected on a GPU machine with `python -m pytest -m gpu` (which `python -m kmix bench gpu`
runs first, within its budget: the file runs in order, the fastest and most telling first).
Each compares against a reference computed another way: a float32 model, float64 NumPy,
Keras's own Adam update, the same model trained without a strategy, a count of the weights.
The `check_*` functions hold the checks; tests/benchmarks/test_gpu.py runs them small on a
CPU in the default suite, so that they cannot rot before a GPU comes.
"""

import math
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix import demo
from kmix.benchmarks import gpt, gpu_routes, memory, train_rounds
from kmix.benchmarks.routes import Route
from kmix.optimizers import updates
from kmix.route import probe as probe_module
from kmix.route import trials

pytestmark = pytest.mark.gpu

GPU = "GPU:0"
SIZE = {"layers": 2, "d_model": 128, "heads": 4, "seq": 64, "vocab": 512, "batch": 8}
STEPS = 20
HALF_DROP = 0.1  # a half route's loss drop over the steps is within this fraction of float32's


def _on(device, tensor_or_variable):
    """Whether a tensor or variable lives on `device` (`"GPU:0"`): its full name ends with it."""
    return tensor_or_variable.device.upper().endswith(device.upper())


def train_route(policy, stack, size=SIZE, steps=STEPS, learning_rate=1e-3, device=GPU, jit_compile=True):
    """Trains a GPT route `steps` steps on one batch, one `fit` epoch a step; returns `(route, losses)`.

    `losses[i]` is step i's loss, before its update: `losses[0]` is the untrained model's.
    """
    route = Route("gpt", size, policy, stack, jit_compile=jit_compile)
    route.model.optimizer.learning_rate.assign(learning_rate)
    history = route.model.fit(route.data, steps_per_epoch=1, epochs=steps, shuffle=False, verbose=0)
    keras.config.set_dtype_policy("float32")
    assert all(_on(device, v.value) for v in route.model.variables), [v.value.device for v in route.model.variables]
    return route, history.history["loss"]


def skipped_steps(optimizer, steps):
    """Steps a route skipped, counted apart from `optimizer.iterations`; checks the two agree."""
    if isinstance(optimizer, kmix.LossScaleOptimizer):
        skipped = int(optimizer.skipped_steps.numpy())
    elif isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # Keras's: starts at 2^15, halves on each overflow, grows only after 2000 finite steps.
        skipped = round(math.log2(2.0**15 / float(optimizer.dynamic_scale.numpy())))
    else:
        skipped = 0
    assert int(optimizer.iterations.numpy()) == steps - skipped, (int(optimizer.iterations.numpy()), skipped)
    return skipped


def check_half_route_trains_like_float32(policy, reference, size=SIZE, steps=STEPS, learning_rate=1e-3, device=GPU,
                                         jit_compile=True):
    """The half route's loss drops as float32's does (`reference`: its losses at `learning_rate`); its matmuls are half."""
    stack = "keras" if policy.startswith("mixed") else "recommended"  # "recommended": autocast + wrap
    route, losses = train_route(policy, stack, size, steps, learning_rate=learning_rate, device=device,
                                jit_compile=jit_compile)
    assert route.jit_compile == jit_compile and all(math.isfinite(v) for v in losses)
    half = kmix.Policy(policy).compute_dtype
    assert half in {layer.compute_dtype for layer in route.model.layers if isinstance(layer, keras.layers.Dense)}
    assert losses[0] == pytest.approx(reference[0], rel=0.01)  # the same untrained model
    float32_drop, half_drop = reference[0] - reference[-1], losses[0] - losses[-1]
    assert float32_drop > 0.2 * reference[0], reference  # the reference itself learned
    assert half_drop == pytest.approx(float32_drop, rel=HALF_DROP), (losses, reference)
    assert skipped_steps(route.model.optimizer, steps) <= 3  # a few overflows at float16's first scales at most


def check_tf32_error(tf32, jit_compile, device=GPU):
    """`a @ b` in float32 with TF32 on or off, against float64: the error relative to the largest entry."""
    previous = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(tf32)
    try:
        rng = np.random.default_rng(0)
        a, b = rng.normal(size=(256, 512)), rng.normal(size=(512, 256))
        with tf.device(device):
            got = tf.function(lambda x, y: x @ y, jit_compile=jit_compile)(a.astype("float32"), b.astype("float32"))
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(previous)
    assert _on(device, got)
    return np.abs(got.numpy() - a @ b).max() / np.abs(a @ b).max()


def check_fused_adam_matches_keras(jit_compile, device=GPU, steps=5):
    """AdamW on TensorFlow's fused kernel against Keras's own update, on `device`, at rtol 1e-6."""
    rng = np.random.default_rng(0)
    start = (rng.uniform(0.5, 1.5, (64, 32)) * rng.choice([-1, 1], (64, 32))).astype("float32")  # none near 0
    grads = [tf.constant(rng.normal(size=(64, 32)).astype("float32")) for _ in range(steps)]
    results = {}
    for fused in (False, True):
        with tf.device(device):
            variable = keras.Variable(start)
            optimizer = keras.optimizers.AdamW(1e-2, weight_decay=0.01)
            assert updates.use_fused_adam(optimizer) if fused else not updates.fused(optimizer)
            optimizer.build([variable])
            step = tf.function(lambda g: optimizer.apply_gradients([(g, variable)]), jit_compile=jit_compile)
            for g in grads:
                step(g)
        ops = {op.type for op in step.get_concrete_function(grads[0]).graph.get_operations()}
        assert ("ResourceApplyAdam" in ops) == fused  # the kernel, not a fallback
        assert _on(device, variable.value)
        results[fused] = variable.numpy()
    assert not np.array_equal(results[False], start)
    np.testing.assert_allclose(results[True], results[False], rtol=1e-6)


def check_mirrored_xla_matches_one_device(device=GPU):
    """`kmix.wrap` under `MirroredStrategy([device])` and XLA: the same weights as without a strategy,
    a non-finite batch skipped on every replica."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    x[17, 3] = np.inf  # in the third of four batches: non-finite gradients, that step skipped

    def fit(strategy):
        with strategy.scope() if strategy else tf.device(device):
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(1)])
            optimizer = kmix.wrap(keras.optimizers.SGD(0.1))
            model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert model.jit_compile and all(_on(device, w.value) for w in model.weights)
        counters = int(optimizer.iterations.numpy()), int(optimizer.skipped_steps.numpy())
        return [w.numpy() for w in model.weights], *counters

    alone, mirrored = fit(None), fit(tf.distribute.MirroredStrategy([device]))
    assert alone[1:] == mirrored[1:] == (3, 1)
    for a, b in zip(alone[0], mirrored[0]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def check_build_estimate_waits_for_the_device(device=GPU, side=4096):
    """`recommend`'s build estimate times a forward pass to its end: at least half a synced pass."""
    with tf.device(device):
        inputs = keras.Input((side,))
        outputs = inputs
        for _ in range(8):
            outputs = keras.layers.Dense(side)(outputs)
        model = keras.Model(inputs, {"out": outputs})
        x = tf.random.normal((side, side))
        model(x)  # built, kernels loaded
        begin = time.perf_counter()
        model(x)["out"].numpy()
        synced = time.perf_counter() - begin
        build, forward = trials.build_estimate(model, x)
    assert forward >= 0.5 * synced
    assert build == pytest.approx(forward * trials.BUILD_FORWARDS)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_fused_adam_kernel_matches_keras_update(jit_compile):
    check_fused_adam_matches_keras(jit_compile)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_tf32_engages_when_on_and_not_when_off(jit_compile):
    """TF32 rounds matmul inputs to 10 mantissa bits: an error above a floor float32 never reaches."""
    gpu = kmix.device.gpus()[0]
    assert check_tf32_error(False, jit_compile) < 1e-5
    if gpu["compute_capability"] is None or tuple(gpu["compute_capability"]) < (8, 0):
        pytest.skip(f"{gpu['name']}: compute capability {gpu['compute_capability']}, no TF32 tensor cores (8.0+)")
    assert 1e-4 < check_tf32_error(True, jit_compile) < 1e-2


def test_mirrored_strategy_with_xla_on_one_gpu():
    check_mirrored_xla_matches_one_device()


@pytest.fixture(scope="module")
def float32_losses():
    """Float32's losses over `STEPS` XLA steps: the reference of every half route."""
    route, losses = train_route("float32", "keras")
    assert skipped_steps(route.model.optimizer, STEPS) == 0
    return losses


@pytest.mark.parametrize("policy", ["O1-bfloat16", "O1-float16", "mixed_float16", "O2-bfloat16", "O2-float16"])
def test_every_route_trains_like_float32_under_xla(policy, float32_losses):
    check_half_route_trains_like_float32(policy, float32_losses)


def test_build_estimate_is_synced():
    check_build_estimate_waits_for_the_device()


def test_the_probe_grows_its_rows_until_a_call_is_not_launch_bound():
    """A small model's shape (1024 rows) is launch-bound on a large GPU: the probe times more rows."""
    shape = (1024, 256, 1024)
    got = kmix.device.probe(shape, budget=0.05)
    limit = probe_module.gpu_row_limit(shape)
    assert got.tf32 == tf.config.experimental.tensor_float_32_execution_enabled()
    assert 1024 <= got.rows <= limit
    fastest = max(got.gflops, key=got.gflops.get)
    seconds = 12 * got.rows * 256 * 1024 / got.gflops[fastest] / 1e9  # the fastest call at those rows
    assert got.rows == limit or seconds >= 0.5 * probe_module.MIN_GPU_CALL_S


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

    with tf.device(GPU):
        x = tf.constant(logits, dtype=dtype)
        probs, grad = run(x)
    assert _on(GPU, probs)
    assert np.isfinite(tf.cast(grad, "float32").numpy()).all()
    kept = np.where(mask, tf.cast(x, "float64").numpy(), -np.inf)
    expected = np.exp(kept - kept.max(axis=1, keepdims=True).clip(-1e300))
    with np.errstate(invalid="ignore"):  # the fully masked row: 0 / 0, made 0 below
        expected = np.nan_to_num(expected / expected.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(probs.numpy(), expected, atol=1e-5)
    assert (probs.numpy()[1] == 0).all()


def test_route_peak_holds_the_weights_and_slots_and_not_the_compile():
    """`bench gpu`'s route row: peak at least float32 weights and two Adam slots; nothing skipped."""
    size = {**SIZE, "rounds": 2, "round_s": 0.2, "min_steps": 2, "max_steps": 50}
    row = gpu_routes.measure(("float32", "float32", "keras", True, True), size)
    assert "error" not in row, row
    with kmix.policy_scope("float32"):
        params = gpt.build_model(size["layers"], size["d_model"], size["heads"], size["seq"], size["vocab"],
                                 "keras").count_params()
    keras.config.set_dtype_policy("float32")
    assert row["peak_bytes"] >= 12 * params  # weights, m and v in float32
    assert row["skipped"] == 0 and row["loss"] < row["loss_first"] and row["steps"] >= 2
    assert train_rounds.largest_batch("float32", "keras", SIZE, 2, 4) == (4, True)  # a tiny model fits


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


def test_demo_on_the_gpu(tmp_path):
    """The hand-written -1e9 mask is NaN from step 1 in float16; kmix's run ends where float32's does."""
    try:
        results = demo.main(["--steps", "40", "--quiet", "--out", str(tmp_path)])
    finally:
        keras.config.set_dtype_policy("float32")
    assert results["naive"]["first_nan_step"] == 1
    assert results["kmix"]["first_nan_step"] is None
    f32, ours = results["float32"], results["kmix"]
    assert abs(ours["final_loss"] - f32["final_loss"]) <= 0.1 * f32["final_loss"] + 0.02  # as tests/demo/test_demo.py
    assert abs(ours["accuracy"] - f32["accuracy"]) <= 0.05
