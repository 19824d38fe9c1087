"""`python -m kmix bench allreduce`: step time with gradients all-reduced in float32, float16, bfloat16."""

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix.benchmarks.common import add_options, alternate, bench_parser, format_table, median, progress, steady

DTYPES = (None, "float16", "bfloat16")
ROWS_PER_WORKER = 2
TIMEOUT = 900  # seconds for the pair


def main(argv=None):
    """Runs the benchmark; prints both tables and returns the timing table's rows."""
    parser = bench_parser("allreduce", __doc__)
    add_options(parser, width=(2048, "units of each Dense layer"), layers=(6, "Dense layers (width^2 parameters each)"),
                steps=(5, "timed steps per dtype and round"), rounds=(3, "rounds over the dtypes"),
                accuracy_steps=(300, "steps of the small MLP (0 skips it)"),
                quick="a smoke test: tiny model, one round, no accuracy")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.steps, args.rounds, args.accuracy_steps = 64, 2, 2, 1, 0
    if args.worker is not None:
        return _worker(args)
    r = _run_pair(list(sys.argv[1:] if argv is None else argv))
    names = ("float32", "float16", "bfloat16")
    rows = [[n, 1e3 * r["step_s"][n], r["skipped"][n], r["bytes"][n] / 1e6, r["step_s"][n] / r["step_s"]["float32"],
             r["bytes"][n] / r["bytes"]["float32"]] for n in names]
    print(f"Two workers on 127.0.0.1, {r['params']:,} parameters, {ROWS_PER_WORKER} rows per worker, SGD, median of "
          f"{args.rounds} x {args.steps} steps:")
    print(format_table(["all-reduce", "step ms", "skipped", "MB per step", "step / float32", "bytes / float32"], rows))
    if r.get("loss"):
        loss = r["loss"]
        print(f"\nA small MLP (regression) under mixed_float16, float32 output layer, Adam 1e-2, {args.accuracy_steps} "
              "steps:\n" + format_table(["all-reduce", "skipped", "held-out loss", "loss / float32"],
                                        [[n, r["loss_skipped"][n], loss[n], loss[n] / loss["float32"]] for n in names]))
    return rows


def _run_pair(argv):
    """Starts the two workers, waits for both (at most `TIMEOUT`), returns worker 0's results."""
    folder, sockets = tempfile.mkdtemp(prefix="kmix_allreduce_"), [socket.socket() for _ in range(2)]
    with sockets[0], sockets[1]:  # two free ports
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        cluster = {"worker": [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    processes, logs = [], [os.path.join(folder, f"worker{index}.log") for index in range(2)]
    progress(f"starting two workers on {', '.join(cluster['worker'])} (logs in {folder})")
    try:
        for index, log in enumerate(logs):
            task = {"type": "worker", "index": index}
            env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": task}), CUDA_VISIBLE_DEVICES="",
                       PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
                       TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
            command = [sys.executable, "-m", "kmix.benchmarks.allreduce", *argv, "--worker", str(index),
                       "--out", folder]
            with open(log, "w") as f:
                processes.append(subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and any(p.poll() is None for p in processes) and not any(
                p.poll() for p in processes):  # both running, or one failed
            time.sleep(0.2)
    finally:
        for p in processes:  # only the two processes started above, by their handles
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in processes]
    if codes != [0, 0]:
        tails = [f"--- worker {i} (exit code {code}):\n" + open(log, errors="replace").read()[-3000:]
                 for i, (code, log) in enumerate(zip(codes, logs))]
        raise RuntimeError("bench allreduce: a worker failed.\n" + "\n".join(tails))
    return json.loads(Path(folder, "results.json").read_text())


def _worker(args):
    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy, global_batch = tf.distribute.MultiWorkerMirroredStrategy(), ROWS_PER_WORKER * 2
    x = tf.random.stateless_normal((global_batch, args.width), (1, 2))
    batch = next(iter(strategy.experimental_distribute_dataset(steady(tf.data.Dataset.from_tensors(x).repeat()))))
    steps, byte_counts, optimizers, params = {}, {}, {}, 0
    for dtype in DTYPES:
        name = dtype or "float32"
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((args.width,))] + [keras.layers.Dense(args.width)
                                                                     for _ in range(args.layers)])
            opt = optimizers[name] = kmix.wrap(keras.optimizers.SGD(1e-6), allreduce_dtype=dtype)
            opt.build(model.trainable_variables)
        params = model.count_params()
        # Bytes one replica sends per step: the gradients in `dtype` (float16: and one float32 bound each).
        byte_counts[name] = sum(int(tf.size(v)) * tf.as_dtype(dtype or getattr(v.dtype, "name", v.dtype)).size
                                + (4 if dtype == "float16" else 0) for v in model.trainable_variables)
        step_fn = functools.partial(_step, model, opt, lambda x, m=model: tf.reduce_sum(tf.square(m(x))) / global_batch)
        step = tf.function(lambda x, f=step_fn: strategy.reduce("SUM", strategy.run(f, args=(x,)), axis=None))
        steps[name] = lambda step=step: [step(batch).numpy() for _ in range(args.steps)]
    report = lambda r, t: print(  # noqa: E731
        f"round {r}: " + ", ".join(f"{n} {1e3 * median(s) / args.steps:.1f} ms" for n, s in t.items()), flush=True)
    times = alternate(steps, args.rounds, warmup=1, after_round=report)  # the warm-up traces each step
    results = {"params": params, "bytes": byte_counts, "step_s": {n: median(t) / args.steps for n, t in times.items()},
               "skipped": {n: int(keras.ops.convert_to_numpy(opt.skipped_steps)) for n, opt in optimizers.items()}}
    if args.accuracy_steps:
        small = {(d or "float32"): _train_small(strategy, d, args.accuracy_steps) for d in DTYPES}
        results["loss"], results["loss_skipped"] = ({n: v[k] for n, v in small.items()} for k in (0, 1))
        print(f"losses: {results['loss']}, skipped: {results['loss_skipped']}", flush=True)
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if index == 0:
        Path(args.out, "results.json").write_text(json.dumps(results))
    # Exits only once the other worker is done (a peer still pulling a buffer fails otherwise).
    open(os.path.join(args.out, f"done{index}"), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(args.out, f"done{1 - index}")) and time.monotonic() < deadline:
        time.sleep(0.1)


def _step(model, opt, loss_of, *batch):
    """A replica's step: the loss of `batch`, scaled, its gradients applied by `opt`; returns the loss."""
    with tf.GradientTape() as tape:
        loss = loss_of(*batch)
        scaled = opt.scale_loss(loss)
    opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
    return loss


def _train_small(strategy, dtype, steps):
    """(held-out MSE, steps skipped) of a mixed_float16 MLP after `steps` steps of Adam reduced in `dtype`."""
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(16, 1)).astype("float32"), rng.normal(size=(4096 + 512, 16)).astype("float32")
    y = 8.0 * (np.tanh(x @ w) + 0.1 * np.sin(3 * x[:, :1]))  # x8: the head's scaled gradient starts above 65504
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
    step_fn = functools.partial(_step, model, opt, lambda xb, yb: tf.nn.compute_average_loss(
        loss_fn(yb, model(xb)), global_batch_size=global_batch))
    step = tf.function(lambda batch: strategy.run(step_fn, args=batch))
    for _ in range(steps):
        step(next(iterator))
    loss = float(np.mean((keras.ops.convert_to_numpy(model(x[4096:])).astype("float32") - y[4096:]) ** 2))
    return loss, int(keras.ops.convert_to_numpy(opt.skipped_steps))


if __name__ == "__main__":
    main()
