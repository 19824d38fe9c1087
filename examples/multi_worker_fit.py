"""`model.fit` on several machines: `MultiWorkerMirroredStrategy` with kmix.

Run without `TF_CONFIG`, this script plays the cluster on one machine: it
starts itself twice as two workers on 127.0.0.1 (loopback ports), waits for
both under a deadline (killing them by pid if they hang), and prints each
worker's final weights checksum. They are equal: both workers hold the same
weights after every step, the skipped one included.

    python examples/multi_worker_fit.py --epochs 3 --bad-batch 5

On real machines, run the same script once per machine with a `TF_CONFIG`
that lists every worker and says which one this is (worker 0 is the chief):

    export TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]},
                       "task": {"type": "worker", "index": 0}}'
    python examples/multi_worker_fit.py --epochs 3

The worker code is ordinary Keras plus one kmix line,
`kmix.distribute.enable_multi_worker_fit()`, without which Keras 3.15's `fit`
fails under this strategy (keras-team/keras#20585). The global batch is split
over all replicas of all workers; Keras's default auto-sharding gives each
worker its half of every batch. `--bad-batch N` puts an inf into worker 1's
half of batch N only (in every epoch): that step is skipped on both workers.
"""

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FEATURES = 8


def worker(args):
    """One worker: the whole training program each machine runs."""
    import keras
    import numpy as np
    import tensorflow as tf

    import kmix

    kmix.distribute.enable_multi_worker_fit()  # before or after creating the strategy
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    kmix.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)  # the same initial weights in every run

    rows = args.batches * args.batch_size
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows + 256, FEATURES)).astype("float32")
    y = (x[:, :4].sum(axis=1, keepdims=True) - 2 * x[:, 4:5]).astype("float32")
    x_train, y_train, x_test, y_test = x[:rows], y[:rows], x[rows:], y[rows:]
    if args.bad_batch is not None:  # row 1 of worker 1's half of that global batch
        x_train[args.bad_batch * args.batch_size + args.batch_size // 2 + 1, 0] = np.inf
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(args.batch_size)
    test = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.batch_size)

    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )
        model.compile(optimizer=kmix.wrap(keras.optimizers.Adam(3e-3)), loss="mse")
    initial_loss = model.evaluate(test, verbose=0)
    model.fit(train, epochs=args.epochs, verbose=2 if index == 0 else 0)
    final_loss = model.evaluate(test, verbose=0)  # the same value on every worker

    weights = model.get_weights()
    checksum = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()
    optimizer = model.optimizer
    print(
        f"worker {index}: checksum={checksum[:16]} weight_sum={sum(float(w.sum()) for w in weights):.6f} "
        f"initial_loss={initial_loss:.6f} final_loss={final_loss:.6f} "
        f"skipped_steps={int(keras.ops.convert_to_numpy(optimizer.skipped_steps))} "
        f"loss_scale={float(keras.ops.convert_to_numpy(optimizer.loss_scale)):g} "
        f"replicas={strategy.num_replicas_in_sync}",
        flush=True,
    )
    # Exit only once the other worker is done: a worker that exits while its peer still pulls
    # the last collective's buffer from it makes that peer fail ("Socket closed").
    done = os.environ["KMIX_EXAMPLE_DONE_DIR"]
    open(os.path.join(done, f"worker{index}"), "w").close()
    while not os.path.exists(os.path.join(done, f"worker{1 - index}")):
        time.sleep(0.1)  # the launcher's deadline bounds this


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(args, argv):
    """Starts two workers on 127.0.0.1, waits (with a deadline), prints their checksums."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
    done = tempfile.mkdtemp(prefix="kmix-workers-")  # where each worker says it has finished
    logs, procs = [], []
    try:
        for index in range(2):
            task = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            env = dict(os.environ, TF_CONFIG=json.dumps(task), KMIX_EXAMPLE_DONE_DIR=done)
            logs.append(tempfile.TemporaryFile("w+"))
            procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if None not in codes or any(c not in (None, 0) for c in codes):
                break  # all done, or one failed: its peer would wait for it forever
            time.sleep(0.2)
    finally:
        for p in procs:  # collectives can hang and ignore SIGTERM: SIGKILL by pid
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(done, ignore_errors=True)
    lines = []
    for index, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        out = log.read()
        found = [line for line in out.splitlines() if line.startswith(f"worker {index}: checksum=")]
        if p.returncode != 0 or not found:
            sys.exit(f"worker {index} failed (exit code {p.returncode}):\n{out[-3000:]}")
        lines.append(found[0])
        print(found[0])
    values = [dict(item.split("=", 1) for item in line.split(": ", 1)[1].split()) for line in lines]
    agree = values[0]["checksum"] == values[1]["checksum"] and values[0]["final_loss"] == values[1]["final_loss"]
    print("both workers hold the same weights" if agree else "the workers' weights DIFFER")
    keys = ("initial_loss", "final_loss", "skipped_steps", "loss_scale", "replicas")
    print("result: " + " ".join(f"{k}={values[0][k]}" for k in keys) + f" workers_agree={agree}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=40, help="global batches per epoch")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--bad-batch", type=int, help="put an inf into worker 1's half of this batch")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the workers are killed")
    args = parser.parse_args(argv)
    if os.environ.get("TF_CONFIG"):
        worker(args)
    else:
        launch(args, argv)


if __name__ == "__main__":
    main()
