"""Mixed-precision training on several machines with `MultiWorkerMirroredStrategy`.

A custom training loop: `strategy.run` over a `tf.GradientTape` step that calls
the kmix optimizer's `scale_loss` and `apply`. `apply` decides whether the step
is finite on the gradients of *every* replica of *every* worker, so an overflow
in one worker's batch skips the step on all of them, and the loss scale,
counters and weights stay identical everywhere.

The other route is `model.fit` with `kmix.distribute.enable_multi_worker_fit()`
(examples/multi_worker_fit.py; Keras 3.15's `fit` needs it under this strategy,
keras-team/keras#20585). A custom loop is for when you want the step in your hands.

Run it from the repository root with kmix installed (`pip install -e .`, or
`PYTHONPATH=.`). On several machines: start this same script once per machine, each
with a `TF_CONFIG` that lists every worker and says which one it is. Machine 0:

    export TF_CONFIG='{"cluster": {"worker": ["host0:12345", "host1:12345"]},
                       "task": {"type": "worker", "index": 0}}'
    python examples/multi_worker.py --steps 200

and the same on machine 1 with `"index": 1`. Each worker uses all of its local
GPUs (one replica per GPU); worker 0 is the chief. The global batch
(`--batch-size`) is split over all replicas of all workers; each worker reads
its own shard of the data (`distribute_datasets_from_function`). Without
`TF_CONFIG` the script runs as a single worker on the local devices:

    python examples/multi_worker.py --steps 50

Test hooks (tests/distribute/test_multi_worker.py runs this script as the
worker program): `--overflow STEP:WORKER` puts an inf into that worker's batch
at that step; `--drop STEP` leaves that step out on every worker; `--save DIR`
writes the final weights and optimizer state to `DIR/worker<index>.npz`.
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmix  # noqa: E402

FEATURES = 8


def worker_index():
    """This process's index in `TF_CONFIG` (0 without one)."""
    config = json.loads(os.environ.get("TF_CONFIG", "{}") or "{}")
    return int(config.get("task", {}).get("index", 0))


def build_model():
    """A small regression MLP; under `mixed_float16` its last layer stays float32."""
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


def make_dataset_fn(global_batch, steps, overflows=()):
    """The input function for `strategy.distribute_datasets_from_function`.

    Each input pipeline (one per worker) makes its own deterministic batches
    from stateless random ops seeded by `(step, pipeline)`, so the data does
    not depend on timing or on which process starts first.

    Args:
        global_batch: examples per step over all replicas.
        steps: how many steps of data to make.
        overflows: `(step, pipeline)` pairs whose batch gets an inf in row 0.
    """
    def dataset_fn(input_context):
        pipeline = input_context.input_pipeline_id
        batch = input_context.get_per_replica_batch_size(global_batch)
        # One element per local replica per step.
        per_step = global_batch // (batch * input_context.num_input_pipelines)
        bad = [s for s, p in overflows if p == pipeline]

        def make(i):
            step = i // per_step
            seed = tf.stack([tf.cast(i, tf.int32), tf.constant(pipeline, tf.int32)])
            x = tf.random.stateless_normal((batch, FEATURES), seed)
            y = tf.reduce_sum(x[:, :4], axis=1, keepdims=True) - x[:, 4:5]
            inject = tf.reduce_any(tf.equal(step, tf.constant(bad + [-1], tf.int64)))
            corrupt = tf.tensor_scatter_nd_update(x, [[0, 0]], [np.inf])
            return tf.where(inject, corrupt, x), y

        return tf.data.Dataset.range(steps * per_step).map(make)

    return dataset_fn


def make_train_step(strategy, model, optimizer, global_batch):
    """One compiled step: forward, scaled backward, `apply` (which may skip)."""
    loss_fn = keras.losses.MeanSquaredError(reduction=None)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)  # all replicas skip together
        return loss

    @tf.function
    def train_step(batch):
        losses = strategy.run(step_fn, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return train_step


def read(value):
    """A Python number from a scalar tensor or variable (mirrored ones included)."""
    return np.asarray(keras.ops.convert_to_numpy(value)).item()


def state_arrays(model, optimizer):
    """What the test compares across workers: weights, the scale and counters."""
    arrays = {f"weight_{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    for name in ("loss_scale", "skipped_steps", "good_steps", "overflow_counts", "iterations"):
        arrays[name] = np.asarray(keras.ops.convert_to_numpy(getattr(optimizer, name)))
    return arrays


def train_custom_loop(strategy, args):
    """Trains `args.steps` steps with the custom loop; returns model and optimizer."""
    with strategy.scope():
        model = build_model()
        optimizer = kmix.wrap(keras.optimizers.Adam(1e-2), growth_interval=args.growth_interval)
        optimizer.build(model.trainable_variables)
    dataset = strategy.distribute_datasets_from_function(
        make_dataset_fn(args.batch_size, args.steps, args.overflow)
    )
    train_step = make_train_step(strategy, model, optimizer, args.batch_size)
    for step, batch in enumerate(dataset):
        if step in args.drop:  # a Python decision, the same on every worker
            continue
        loss = train_step(batch)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(
                f"worker {worker_index()} step {step}: loss {float(loss):.4f} "
                f"scale {read(optimizer.loss_scale):g} skipped {read(optimizer.skipped_steps):g}",
                flush=True,
            )
    return model, optimizer


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--growth-interval", type=int, default=2000)
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--overflow", action="append", default=[], metavar="STEP:WORKER",
                        help="put an inf into WORKER's batch at STEP (repeatable)")
    parser.add_argument("--drop", action="append", type=int, default=[], metavar="STEP",
                        help="leave STEP out on every worker (repeatable)")
    parser.add_argument("--save", metavar="DIR", help="write DIR/worker<index>.npz at the end")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)
    args.overflow = [tuple(int(p) for p in o.split(":")) for o in args.overflow]
    args.drop = set(args.drop)
    return args


def main(argv=None):
    args = parse_args(argv)
    keras.config.set_dtype_policy(args.policy)
    keras.utils.set_random_seed(0)  # the same initial weights on every worker
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    print(f"worker {worker_index()}: {strategy.num_replicas_in_sync} replicas in sync", flush=True)
    model, optimizer = train_custom_loop(strategy, args)
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        path = os.path.join(args.save, f"worker{worker_index()}.npz")
        np.savez(path, **state_arrays(model, optimizer))
        print(f"worker {worker_index()}: wrote {path}", flush=True)


if __name__ == "__main__":
    main()
