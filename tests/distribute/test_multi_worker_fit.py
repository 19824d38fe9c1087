"""`model.fit` under `MultiWorkerMirroredStrategy` with `kmix.distribute.enable_multi_worker_fit()`.

Two worker processes on 127.0.0.1 (tests/distribute/fit_worker.py) against a
reference process running `MirroredStrategy` over two logical CPUs on the same
global batches; then (`KMIX_FULL_TESTS=1`) a pair in which worker 1 dies
mid-training and both are restarted from `BackupAndRestore`. Every process runs under a deadline and is
killed by its pid (a collective whose peer died waits forever); a hang fails.
The in-process tests check the switch itself and Keras's own LossScaleOptimizer
under `MirroredStrategy`.
"""

import json
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix import _compat
from tests.fault.processes import REPO, Worker, free_ports, report, run_all, worker_env
from tests.testing import FULL, full_only

SCRIPT = REPO / "tests" / "distribute" / "fit_worker.py"
TIMEOUT = 240  # seconds for a group of processes; a group takes 20-40 s on two idle cores
STEPS = 6  # 44 rows in global batches of 8: five full batches and one of 4


def start(out, strategy, *args, tf_config=None):
    env = worker_env(STACKS_AFTER=str(TIMEOUT - 20))  # Python stacks in the log if it hangs
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    name = f"{strategy}{tf_config['task']['index'] if tf_config else ''}"
    return Worker([SCRIPT, "--strategy", strategy, "--out", out, *args], out / f"{name}.log", env)


def run_group(out, *args, reference=False):
    """Two workers (and the MirroredStrategy reference); returns (workers, codes)."""
    out.mkdir(parents=True, exist_ok=True)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    workers = []
    try:
        for index in range(2):
            config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            workers.append(start(out, "multi_worker", *args, tf_config=config))
        if reference:
            workers.append(start(out, "mirrored", *args))
    finally:
        codes = run_all(workers, TIMEOUT)
    return workers, codes


def load(out, name):
    return dict(np.load(out / f"{name}.npz"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario in one pair of workers plus the reference (`backup_*` only where a test reads it)."""
    root = tmp_path_factory.mktemp("multi_worker_fit")
    main = root / "main"
    backup = ["--backup-root", main / "backup"] if FULL else []
    workers, codes = run_group(main, *backup, reference=True)
    assert codes == [0, 0, 0], report(workers, codes)
    results = {name: load(main, name) for name in ("multi_worker0", "multi_worker1", "mirrored0")}
    results["mirrored"] = results.pop("mirrored0")
    return results


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """The pair in which worker 1 dies mid-training, then both restarted from `BackupAndRestore`."""
    results = {}
    resumed = tmp_path_factory.mktemp("multi_worker_fit_resumed")
    backup = ["--scenario", "backup", "--backup-root", resumed / "backup"]
    workers, codes = run_group(resumed, *backup, "--die-at", "1:2")
    assert codes[1] == -9 and codes[0] != 0, report(workers, codes)  # 1 died; 0 was stuck, killed
    assert "dying at 1:2" in workers[1].output(), report(workers, codes)
    killed_logs = [w.output(tail=None) for w in workers]
    workers, codes = run_group(resumed, *backup)
    assert codes == [0, 0], report(workers, codes)
    results["resumed"] = [load(resumed, f"multi_worker{i}") for i in range(2)]
    results["resumed_logs"] = [w.output(tail=None) for w in workers]
    results["killed_logs"] = killed_logs
    return results


def assert_same(first, second, prefix, what):
    keys = sorted(k for k in first if k.startswith(prefix) and not k.endswith("_loss"))
    assert keys and keys == sorted(k for k in second if k.startswith(prefix) and not k.endswith("_loss"))
    for key in keys:
        np.testing.assert_array_equal(first[key], second[key], err_msg=f"{key}: {what}")


def test_fit_skips_an_overflow_on_both_workers_like_mirrored(runs):
    w0, w1, mirrored = runs["multi_worker0"], runs["multi_worker1"], runs["mirrored"]
    assert_same(w0, w1, "kmix_", "worker 0 != worker 1")
    assert_same(w0, mirrored, "kmix_", "workers != MirroredStrategy on the same global batches")
    # The inf is in worker 1's half of batch 2 only: one skip on each worker, one back-off.
    assert int(w0["kmix_skipped_steps"]) == 1
    assert int(w0["kmix_iterations"]) == STEPS - 1
    assert float(w0["kmix_dynamic_scale"]) == 2.0**9
    assert all(np.isfinite(w0[k]).all() for k in w0 if k.startswith("kmix_w"))


def test_evaluate_and_predict_agree_on_both_workers(runs):
    w0, w1, mirrored = runs["multi_worker0"], runs["multi_worker1"], runs["mirrored"]
    for key in ("kmix_evaluate", "kmix_val_loss", "kmix_predict"):
        np.testing.assert_array_equal(w0[key], w1[key], err_msg=key)
        np.testing.assert_array_equal(w0[key], mirrored[key], err_msg=key)
    # validation_data inside fit evaluated the same model on the same rows.
    np.testing.assert_allclose(w0["kmix_val_loss"][-1], w0["kmix_evaluate"], rtol=1e-6)
    # predict: all 20 rows (batches of 8, 8 and 4) in order, as one direct call gives them.
    assert w0["kmix_predict"].shape == (20, 1)
    np.testing.assert_allclose(w0["kmix_predict"], w0["kmix_direct"], atol=2e-3)


def test_steps_per_execution_2_runs_the_same_steps(runs):
    # Keras 3.15 fails with steps_per_execution > 1 under any strategy (keras-team/keras#19246);
    # kmix's loop runs the same steps: everything equals the one-step-per-execution run.
    for name in ("multi_worker0", "multi_worker1", "mirrored"):
        result = runs[name]
        one_step = {k[len("kmix_"):]: v for k, v in result.items() if k.startswith("kmix_")}
        two_steps = {k[len("steps2_"):]: v for k, v in result.items() if k.startswith("steps2_")}
        one_step.pop("direct")
        assert sorted(one_step) == sorted(two_steps), name
        for key in one_step:  # weights, scale, counters, loss, val_loss, evaluate, predict
            np.testing.assert_array_equal(two_steps[key], one_step[key], err_msg=f"{name}: {key}")
    assert int(runs["multi_worker0"]["steps2_skipped_steps"]) == 1


def test_keras_loss_scale_optimizer_and_a_subclass(runs):
    """A user subclass of Keras's own LossScaleOptimizer (another default initial scale, 2^8): it runs
    every line Keras's class runs, kmix's wrapper of `apply` included (inherited, as
    test_enable_is_idempotent_and_disable_restores_keras checks it is installed on Keras's class)."""
    w0, w1, mirrored = runs["multi_worker0"], runs["multi_worker1"], runs["mirrored"]
    prefix = "subclass_"
    assert_same(w0, w1, prefix, "worker 0 != worker 1")
    assert_same(w0, mirrored, prefix, "workers != MirroredStrategy")
    assert int(w0[prefix + "iterations"]) == STEPS - 1  # the inf batch skipped everywhere
    assert float(w0[prefix + "dynamic_scale"]) == 2.0**8 / 2
    assert all(np.isfinite(w0[k]).all() for k in w0 if k.startswith(prefix + "w"))


# Tolerance against the float32-reduced run: each replica's gradient and each sum rounded to the
# half dtype (relative 2^-11 for float16, 2^-8 for bfloat16), through five Adam steps of lr 1e-2
# on a nonlinear model (so not a rounding bound: the errors go through Adam's normalisation).
HALF_ATOL = {"float16": 2e-3, "bfloat16": 1e-2}
# Each dtype through one route (the reduction is the same code in both, in the optimizer's `apply`):
# float16 through fit, against the float32-reduced `kmix_` fit of the same process; bfloat16 through
# a custom loop, against that loop with float32 sums (run once, in the MirroredStrategy process: a sum
# of two float32 values is the same whoever adds).
ROUTES = {
    "float16": ("fit_float16_", "multi_worker0", "kmix_"),
    "bfloat16": ("loop_bfloat16_", "mirrored", "loop_float32_"),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_allreduce_dtype_on_two_workers(runs, dtype):
    w0, w1, mirrored = runs["multi_worker0"], runs["multi_worker1"], runs["mirrored"]
    prefix, source, reference = ROUTES[dtype]
    float32 = runs[source]
    assert_same(w0, w1, prefix, "worker 0 != worker 1")
    # A sum of two half values is one rounding whoever adds: the same as MirroredStrategy.
    assert_same(w0, mirrored, prefix, "workers != MirroredStrategy")
    # The inf in worker 1's half of batch 2 is found on the sums: skipped, scale backed off.
    assert int(w0[prefix + "skipped_steps"]) == 1
    assert float(w0[prefix + "dynamic_scale"]) == 2.0**9
    assert int(w0[prefix + "iterations"]) == int(float32[reference + "iterations"])
    weights = sorted(k[len(prefix):] for k in w0 if k.startswith(prefix + "w"))
    for key in weights:
        np.testing.assert_allclose(w0[prefix + key], float32[reference + key], atol=HALF_ATOL[dtype],
                                   err_msg=prefix + key)
    # The half sums did round: not the float32-reduced weights bit for bit.
    assert any(not np.array_equal(w0[prefix + k], float32[reference + k]) for k in weights)


@full_only("two more groups of worker processes, about 55 s on 2 cores")
def test_backup_and_restore_after_a_worker_is_killed(runs, resumed_runs):
    uninterrupted = runs["multi_worker0"]
    assert_same(uninterrupted, runs["multi_worker1"], "backup_", "worker 0 != worker 1")
    assert_same(uninterrupted, runs["mirrored"], "backup_", "workers != MirroredStrategy")
    runs = resumed_runs
    for index, resumed in enumerate(runs["resumed"]):
        assert_same(resumed, uninterrupted, "backup_", f"resumed worker {index} != uninterrupted")
    # The restarted workers began at epoch 1 (restored), not at epoch 0.
    for index, log in enumerate(runs["resumed_logs"]):
        assert "epoch 1 begins" in log and "epoch 0 begins" not in log, log[-2000:]
        # This scenario never calls enable_multi_worker_fit: kmix.wrap in the scope did.
        assert f"multi_worker {index}: enabled True" in log, log[-2000:]
    assert "epoch 1 begins" in runs["killed_logs"][1]


# ---------------------------------------------------------------- in process, no workers
def test_probe_sees_both_bugs_in_this_keras_and_none_in_fixed_code():
    bugs = _compat.keras_multi_worker_bugs(_compat.keras_symbolic_build(), _compat.keras_reduce_per_replica())
    if keras.__version__ == "3.15.1":
        assert bugs == {"symbolic_build": True, "reduce_per_replica": True}

    def fixed_build(self, iterator=None, data_batch=None):  # maps over the leaves
        for _, _, it in iterator:
            batch = next(it)
            tf.nest.map_structure(lambda v: self.distribute_strategy.reduce("MEAN", v, axis=None), batch)

    def fixed_reduce(values, strategy, reduction):
        return tf.nest.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)

    assert _compat.keras_multi_worker_bugs(fixed_build, fixed_reduce) == {
        "symbolic_build": False,
        "reduce_per_replica": False,
    }
    assert _compat.keras_multi_worker_bugs(lambda *a, **k: 1 / 0, lambda *a: 1 / 0) == {
        "symbolic_build": None,
        "reduce_per_replica": None,
    }


def _fixed_make_function(model, step_function):
    """A `_make_function` as Keras might fix it: the step outside any tf.cond."""

    @tf.function
    def multi_step(iterator):
        return model.distribute_strategy.run(step_function, args=(iterator.get_next(),))

    return multi_step


def test_probe_sees_steps_traced_inside_a_cond():
    if keras.__version__ == "3.15.1":
        assert _compat.keras_steps_in_cond(_compat.keras_make_function()) is True
    assert _compat.keras_steps_in_cond(_fixed_make_function) is False
    assert _compat.keras_steps_in_cond(lambda *a: 1 / 0) is None


def test_a_fixed_keras_keeps_its_own_loop_and_says_so(caplog):
    from kmix.distribute import multi_step

    model = types.SimpleNamespace(
        steps_per_execution=2, run_eagerly=False, _distribute_strategy=tf.distribute.get_strategy()
    )
    make_function = multi_step.make_function_replacement(_fixed_make_function)
    with caplog.at_level("WARNING", logger="kmix"):
        function = make_function(model, lambda data: data)
    assert function.__qualname__.startswith("_fixed_make_function.")  # Keras's (here, the fixed) loop
    assert "no longer has the multi-step loop bug of keras-team/keras#19246" in caplog.text


def _installed():
    return (_compat.keras_symbolic_build(), _compat.keras_reduce_per_replica(), _compat.keras_make_function())


def test_enable_is_idempotent_and_disable_restores_keras():
    keras_functions = _installed()
    keras_build, keras_reduce, keras_make_function = keras_functions
    keras_apply = keras.optimizers.LossScaleOptimizer.apply
    try:
        assert kmix.distribute.enable_multi_worker_fit() is True
        installed = _installed()
        assert kmix.distribute.enable_multi_worker_fit() is True
        assert _installed() == installed
        for replacement, original in zip(installed, keras_functions):
            assert replacement.kmix_replaces is original
        assert keras.optimizers.LossScaleOptimizer.apply.kmix_replaces is keras_apply
        assert kmix.distribute.multi_worker_fit_enabled()
        # Outside MultiWorkerMirroredStrategy the replacement is Keras's own function.
        logs = {"loss": tf.constant(2.5)}
        assert installed[1](logs, tf.distribute.get_strategy(), "auto") == keras_reduce(
            logs, tf.distribute.get_strategy(), "auto"
        )
    finally:
        kmix.distribute.disable_multi_worker_fit()
    assert _installed() == keras_functions
    assert keras.optimizers.LossScaleOptimizer.apply is keras_apply
    assert not kmix.distribute.multi_worker_fit_enabled()
    assert kmix.distribute.disable_multi_worker_fit() is False


def _keras_lso_step_with_inf_on_replica_1(strategy):
    """One step of Keras's own LossScaleOptimizer on two replicas; replica 1's gradient is inf."""
    with strategy.scope():
        w = keras.Variable(np.ones(3, "float32"))
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
        opt.build([w])

    def step():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        grad = tf.where(tf.equal(replica, 1), np.inf, 1.0) * tf.ones(3)
        opt.apply([grad], [w])

    tf.function(lambda: strategy.run(step))()
    return keras.ops.convert_to_numpy(w), float(keras.ops.convert_to_numpy(opt.dynamic_scale))


@full_only("Keras's own LossScaleOptimizer under MirroredStrategy, about 30 s on 2 cores")
def test_keras_loss_scale_optimizer_skips_when_any_replica_overflows():
    if len(tf.config.list_logical_devices("CPU")) < 2:
        pytest.skip("needs the two logical CPUs tests/conftest.py sets up")
    # No collective ops: every MirroredStrategy in a process starts at the same collective
    # keys, and a key reused with another shape fails (here, or in a later test).
    strategy = tf.distribute.MirroredStrategy(
        ["CPU:0", "CPU:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    try:
        kmix.distribute.enable_multi_worker_fit()
        weights, scale = _keras_lso_step_with_inf_on_replica_1(strategy)
    finally:
        kmix.distribute.disable_multi_worker_fit()
    np.testing.assert_array_equal(weights, np.ones(3, "float32"))  # skipped: nothing applied
    assert scale == 2.0
    if keras.__version__ == "3.15.1":
        # Keras's own decision reads replica 0's gradients only: the inf gets applied.
        weights, scale = _keras_lso_step_with_inf_on_replica_1(strategy)
        assert not np.isfinite(weights).all() and scale == 4.0


def _bert_on_two_replicas(steps_per_execution):
    """A keras-hub BERT classifier trained under mixed_float16 and MirroredStrategy, 5 batches."""
    keras_hub = pytest.importorskip("keras_hub")
    strategy = tf.distribute.MirroredStrategy(
        ["CPU:0", "CPU:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    rng = np.random.default_rng(0)
    rows, seq = 36, 8  # batches of 8: the last one partial
    x = {
        "token_ids": rng.integers(1, 50, (rows, seq)).astype("int32"),
        "segment_ids": np.zeros((rows, seq), "int32"),
        "padding_mask": (np.arange(seq)[None] < rng.integers(4, seq + 1, (rows, 1))).astype("int32"),
    }
    y = rng.integers(0, 2, (rows,)).astype("int32")
    with kmix.policy_scope("mixed_float16"), strategy.scope():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, max_sequence_length=seq
        )
        pooled = keras.ops.mean(backbone.output["sequence_output"][:, :4, :], axis=1)  # keras.ops nodes
        model = keras.Model(backbone.input, keras.layers.Dense(2, dtype="float32")(pooled))
        model.compile(
            optimizer=kmix.wrap(keras.optimizers.AdamW(1e-3)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), verbose=0)
    loop = model.train_function.__qualname__  # whose multi-step loop ran
    state = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    return model.get_weights() + state, history.history["loss"], loop


@full_only("Keras's own steps_per_execution under MirroredStrategy, about 22 s on 2 cores")
def test_steps_per_execution_under_mirrored_strategy():
    # Keras's own loop fails here only with collective all-reduces (MirroredStrategy's default
    # on CPUs, MultiWorkerMirroredStrategy's always), which repeat keys across the strategies
    # of one process: the worker processes above show that failure fixed. This checks that
    # kmix's loop runs the same steps on a keras-hub model, a partial execution included.
    if len(tf.config.list_logical_devices("CPU")) < 2:
        pytest.skip("needs the two logical CPUs tests/conftest.py sets up")
    reference = _bert_on_two_replicas(1)
    try:
        kmix.distribute.enable_multi_worker_fit()
        arrays, losses, loop = _bert_on_two_replicas(3)  # 5 batches: executions of 3 and 2
    finally:
        kmix.distribute.disable_multi_worker_fit()
    if keras.__version__ == "3.15.1":
        assert loop.startswith("make_function_replacement."), loop
    np.testing.assert_array_equal(losses, reference[1])
    assert len(arrays) == len(reference[0])
    for got, want in zip(arrays, reference[0]):  # weights, slots, scale, counters
        np.testing.assert_array_equal(got, want)
