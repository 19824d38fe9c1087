"""`python -m kmix bench allreduce`: step time with gradients all-reduced in float32, float16, bfloat16.

Starts two `MultiWorkerMirroredStrategy` workers on 127.0.0.1 (this module,
run twice with a `TF_CONFIG` each) and trains a communication-bound model,
a stack of wide `Dense` layers (25M parameters by default) on a batch of 2
rows per worker, with `kmix.wrap(SGD, allreduce_dtype=...)` for each
reduction dtype, rounds alternating so that drift on a shared machine hits
every dtype. Each worker uses one intra-op thread (two workers on a 2-core
machine stand for two machines). Prints per dtype the median step time, the
steps skipped for non-finite sums, the bytes each worker sends into the
all-reduces per step, and the ratios to float32; then the accuracy table: a
small MLP under `mixed_float16` with a float32 output layer (whose scaled
gradient is above float16's 65504 at the start) trained for
`--accuracy-steps` steps with `kmix.wrap(Adam)` and each reduction: its
steps skipped and its loss on held-out rows at the end.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from kmix.benchmarks.common import format_table, median, progress, steady

DTYPES = (None, "float16", "bfloat16")
ROWS_PER_WORKER = 2
TIMEOUT = 900  # seconds for the pair


def main(argv=None):
    """Runs the benchmark; returns the rows of the timing table (and prints both tables)."""
    parser = argparse.ArgumentParser(prog="python -m kmix bench allreduce", description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="units of each Dense layer")
    parser.add_argument("--layers", type=int, default=6, help="Dense layers (width^2 parameters each)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per dtype and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the dtypes")
    parser.add_argument("--accuracy-steps", type=int, default=300, help="steps of the small MLP; 0 skips it")
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny model, one round, no accuracy")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.steps, args.rounds, args.accuracy_steps = 64, 2, 2, 1, 0
    if args.worker is not None:
        _worker(args)
        return None
    results = _run_pair(list(sys.argv[1:] if argv is None else argv), args)
    rows = _timing_rows(results, args)
    print(f"Two workers on 127.0.0.1, {results['params']:,} parameters, "
          f"{ROWS_PER_WORKER} rows per worker, SGD, median of {args.rounds} x {args.steps} steps:")
    print(format_table(["all-reduce", "step ms", "skipped", "MB per step", "step / float32", "bytes / float32"], rows))
    if results.get("loss"):
        print(f"\nA small MLP (regression) under mixed_float16, float32 output layer, Adam 1e-2, "
              f"{args.accuracy_steps} steps:")
        print(format_table(["all-reduce", "skipped", "held-out loss", "loss / float32"], _accuracy_rows(results)))
    return rows


def _timing_rows(results, args):
    base = results["step_s"]["float32"]
    base_bytes = results["bytes"]["float32"]
    return [
        [name, 1e3 * results["step_s"][name], results["skipped"][name], results["bytes"][name] / 1e6,
         results["step_s"][name] / base, results["bytes"][name] / base_bytes]
        for name in ("float32", "float16", "bfloat16")
    ]


def _accuracy_rows(results):
    base = results["loss"]["float32"]
    return [[name, results["loss_skipped"][name], results["loss"][name], results["loss"][name] / base]
            for name in ("float32", "float16", "bfloat16")]


# ------------------------------------------------------------------ the pair
def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _run_pair(argv, args):
    """Starts the two workers, waits for both (with a deadline), returns worker 0's results."""
    folder = tempfile.mkdtemp(prefix="kmix_allreduce_")
    cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(2)]}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    processes, logs = [], []
    progress(f"starting two workers on {', '.join(cluster['worker'])} (logs in {folder})")
    try:
        for index in range(2):
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            env["CUDA_VISIBLE_DEVICES"] = ""
            log = open(os.path.join(folder, f"worker{index}.log"), "w")
            logs.append(log)
            command = [sys.executable, "-m", "kmix.benchmarks.allreduce", *argv, "--worker", str(index), "--out", folder]
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT
        while True:
            codes = [p.poll() for p in processes]
            if None not in codes or any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in processes:  # only the two processes started above, by their handles
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs:
            log.close()
    codes = [p.returncode for p in processes]
    if codes != [0, 0]:
        tails = []
        for index in range(2):
            with open(os.path.join(folder, f"worker{index}.log"), errors="replace") as f:
                tails.append(f"--- worker {index} (exit code {codes[index]}):\n" + f.read()[-3000:])
        raise RuntimeError("bench allreduce: a worker failed.\n" + "\n".join(tails))
    with open(os.path.join(folder, "results.json")) as f:
        return json.load(f)


# ---------------------------------------------------------------- one worker
def _worker(args):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    import kmix
    from kmix.optimizers import allreduce

    def big_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((args.width,))] + [keras.layers.Dense(args.width) for _ in range(args.layers)]
        )

    global_batch = ROWS_PER_WORKER * 2
    x = tf.random.stateless_normal((global_batch, args.width), (1, 2))
    dataset = steady(tf.data.Dataset.from_tensors(x).repeat())
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    steps, times, byte_counts, optimizers, params = {}, {}, {}, {}, 0
    for dtype in DTYPES:
        with strategy.scope():
            model = big_model()
            opt = kmix.wrap(keras.optimizers.SGD(1e-6), allreduce_dtype=dtype)
            opt.build(model.trainable_variables)
        params = model.count_params()
        name = dtype or "float32"
        byte_counts[name] = allreduce.bytes_per_step(model.trainable_variables, dtype)
        steps[name] = _make_step(strategy, model, opt, global_batch)
        optimizers[name] = opt
        times[name] = []
        steps[name](batch).numpy()  # trace and warm up
    for r in range(args.rounds):
        for name, step in steps.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                step(batch).numpy()
                times[name].append(time.perf_counter() - start)
        print(f"round {r}: " + ", ".join(f"{n} {1e3 * median(t):.1f} ms" for n, t in times.items()), flush=True)
    results = {"params": params, "bytes": byte_counts, "step_s": {n: median(t) for n, t in times.items()},
               "skipped": {n: _skipped(keras, opt) for n, opt in optimizers.items()}}
    if args.accuracy_steps:
        small = {(d or "float32"): _train_small(strategy, keras, kmix, d, args.accuracy_steps) for d in DTYPES}
        results["loss"] = {n: loss for n, (loss, _) in small.items()}
        results["loss_skipped"] = {n: skipped for n, (_, skipped) in small.items()}
        print(f"losses: {results['loss']}, skipped: {results['loss_skipped']}", flush=True)
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if index == 0:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f)
    _wait_for_peer(args.out, index)


def _make_step(strategy, model, opt, global_batch):
    import tensorflow as tf

    def step_fn(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x))) / global_batch
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
        return loss

    @tf.function
    def step(x):
        return strategy.reduce("SUM", strategy.run(step_fn, args=(x,)), axis=None)

    return step


def _skipped(keras, opt):
    return int(keras.ops.convert_to_numpy(opt.skipped_steps))


def _train_small(strategy, keras, kmix, dtype, steps):
    """(held-out MSE, steps skipped) of a mixed_float16 MLP after `steps` steps of Adam reduced in `dtype`.

    Its float32 output layer's gradient times the loss scale (2^15) is above
    65504 at the start: cast for a float16 wire as it is, it would be inf.
    """
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 1)).astype("float32")
    x = rng.normal(size=(4096 + 512, 16)).astype("float32")
    y = np.tanh(x @ w) + 0.1 * np.sin(3 * x[:, :1])
    y = 8.0 * y  # errors of several units at the start: the head's scaled gradient is above 65504
    with strategy.scope(), kmix.policy_scope("mixed_float16"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1, dtype="float32")])
        opt = kmix.wrap(keras.optimizers.Adam(1e-2), allreduce_dtype=dtype)
        opt.build(model.trainable_variables)
    global_batch = 32
    train = tf.data.Dataset.from_tensor_slices((x[:4096], y[:4096])).repeat().batch(global_batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    iterator = iter(strategy.experimental_distribute_dataset(train.with_options(options)))
    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb)), global_batch_size=global_batch)
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    step = tf.function(lambda batch: strategy.run(step_fn, args=batch))
    for _ in range(steps):
        step(next(iterator))
    loss = float(np.mean((keras.ops.convert_to_numpy(model(x[4096:])).astype("float32") - y[4096:]) ** 2))
    return loss, _skipped(keras, opt)


def _wait_for_peer(folder, index):
    """Exits only once the other worker is done (a peer still pulling a buffer fails otherwise)."""
    open(os.path.join(folder, f"done{index}"), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(folder, f"done{1 - index}")) and time.monotonic() < deadline:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
