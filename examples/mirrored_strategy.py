"""Data-parallel mixed-precision training with `tf.distribute.MirroredStrategy` and `model.fit`.

Every replica computes gradients on its share of the global batch; they are
summed across replicas before the loss-scale optimizer checks them, so an
overflow on any one replica skips the step on all of them and the replicas
stay identical. (Keras 3.15's own `LossScaleOptimizer` reads only the first
replica's flag.)

With GPUs the strategy uses all of them. Without one, this script splits the
CPU into two logical devices, which must happen before TensorFlow initialises
its devices, i.e. at the top of the program before any other TensorFlow call:

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

What kmix adds: build and compile inside `strategy.scope()` with
`kmix.wrap(optimizer)`; nothing else changes.

`--bad-batch N` puts a NaN into the first example of batch N, which lands on
the first replica only: the step is skipped on every replica.

Run:

    python examples/mirrored_strategy.py                   # under a minute on a CPU
    python examples/mirrored_strategy.py --steps 30 --bad-batch 3

The last line printed is `result: initial_loss=... final_loss=... accuracy=...
skipped_steps=... loss_scale=... replicas=... replicas_agree=...`.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

# Before anything else touches TensorFlow: two logical CPUs when there is no GPU.
if not tf.config.list_physical_devices("GPU"):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kmix  # noqa: E402

FEATURES = 32
CLASSES = 10


def make_data(n, seed):
    """Gaussian clusters: one centre per class, in 32 dimensions."""
    centres = np.random.default_rng(123).normal(size=(CLASSES, FEATURES)).astype(np.float32)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, size=n).astype(np.int32)
    x = centres[y] + rng.normal(size=(n, FEATURES)).astype(np.float32)
    return x, y


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps; default 300")
    parser.add_argument("--batch", type=int, default=128, help="global batch size; default 128")
    parser.add_argument("--policy", default="mixed_float16", help="a kmix policy; default mixed_float16")
    parser.add_argument("--bad-batch", type=int, default=None,
                        help="put a NaN into the first example of this batch (0-based)")
    args = parser.parse_args(argv)

    gpus = tf.config.list_logical_devices("GPU")
    devices = [d.name for d in gpus] or [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices)
    print(f"replicas: {strategy.num_replicas_in_sync} ({', '.join(devices)})")

    kmix.set_policy(args.policy)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(CLASSES, activation="softmax", dtype="float32"),
        ])
        model.compile(
            optimizer=kmix.wrap(keras.optimizers.Adam(1e-3)),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )

    x, y = make_data(args.steps * args.batch, seed=0)
    if args.bad_batch is not None:
        x[args.bad_batch * args.batch, 0] = np.nan
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
    test = tf.data.Dataset.from_tensor_slices(make_data(1024, seed=1)).batch(256)
    initial_loss, _ = model.evaluate(test, verbose=0)
    model.fit(train, epochs=1, shuffle=False, verbose=2, callbacks=[kmix.callbacks.LossScaleMonitor()])
    final_loss, accuracy = model.evaluate(test, verbose=0)

    # Every replica holds its own copy of each variable; they must be equal.
    agree = all(
        all(np.array_equal(copies[0], c) for c in copies[1:])
        for copies in (
            [np.asarray(v) for v in strategy.experimental_local_results(w.value)]
            for w in model.weights
        )
    )
    opt = model.optimizer
    # int(variable) does not accept a mirrored variable: read it through numpy.
    skipped = int(keras.ops.convert_to_numpy(opt.skipped_steps))
    print(f"result: initial_loss={initial_loss:.5f} final_loss={final_loss:.5f} accuracy={accuracy:.4f} "
          f"skipped_steps={skipped} loss_scale={float(opt.loss_scale):g} "
          f"replicas={strategy.num_replicas_in_sync} replicas_agree={agree}")


if __name__ == "__main__":
    main()
