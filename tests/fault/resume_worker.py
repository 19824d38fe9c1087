"""The training program that tests/fault/test_resume.py kills and restarts.

`model.fit` of a float16-parameter model with `kmix.wrap(Adam, master_weights=True)`,
`kmix.callbacks.LearningRateWarmup` and `keras.callbacks.BackupAndRestore`
(a checkpoint every `SAVE_FREQ` batches), on deterministic data with injected
overflow batches.

What Keras 3.15 restores: `BackupAndRestore` saves the model and optimizer
variables and `{"epoch", "batch"}` every `save_freq` batches, but on restart it
reads only `"epoch"`: `fit` starts that epoch again from its first batch, with
the weights of the middle of the epoch. Replaying those batches would train on
them twice. So the data here is a stream of batches indexed by the global step
(batches consumed so far, `iterations + skipped_steps` of the kmix optimizer,
both restored from the checkpoint), `DataPosition` points the stream at the
restored step when training begins, and `StopAtStep` ends training after
`TOTAL` steps instead of counting epochs. Then a resumed run sees exactly the
batches an uninterrupted run sees after that step.

Usage: python tests/fault/resume_worker.py --backup DIR --log FILE --out FILE.npz [--stall-at STEP]
    [--mode o2|o1-accumulation] [--reference PREFIX]
`--stall-at` writes the log line of that step and then waits (for SIGKILL).
`--reference PREFIX` first trains an uninterrupted run in this process (a new
model, the same seed), with `PREFIX_backup/`, `PREFIX.jsonl` and `PREFIX.npz`:
the test's reference, without a process of its own.
"""

import argparse
import json
import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kmix  # noqa: E402

TOTAL = 40  # steps (batches) of the whole run
STEPS_PER_EPOCH = 12
EPOCHS = math.ceil(TOTAL / STEPS_PER_EPOCH) + 1  # room for the epoch Keras starts again
SAVE_FREQ = 15  # BackupAndRestore saves after batches 15, 30, ... of each process (each save: ~0.2 s CPU)
WARMUP_STEPS = 30
OVERFLOW_STEPS = (3, 8, 16, 21, 33)  # global steps whose input holds an inf
BATCH, FEATURES = 8, 6


def batch_at(step):
    """The batch of global step `step`: the same in every run."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(BATCH, FEATURES)).astype("float32")
    y = (x[:, :2].sum(axis=1, keepdims=True) - x[:, 2:3]).astype("float32")
    if step in OVERFLOW_STEPS:
        x[0, 0] = np.inf
    return x, y


def steps_done(optimizer):
    """Batches consumed so far: applied (`iterations`) plus skipped, in micro-batches when accumulating."""
    if not optimizer.built:
        return 0
    steps = int(optimizer.iterations.numpy()) + int(optimizer.skipped_steps.numpy())
    if optimizer.accumulation_steps == 1:
        return steps
    # The micro-batches of the open window: kmix's own counter, saved with the optimizer.
    return steps * optimizer.accumulation_steps + int(optimizer._micro_step.numpy())


class DataPosition(keras.callbacks.Callback):
    """Points the data stream at the restored step (place it after BackupAndRestore)."""

    def __init__(self):
        super().__init__()
        self.start = None
        self.first_batch = None

    def on_train_begin(self, logs=None):
        self.start = steps_done(self.model.optimizer)

    def on_epoch_begin(self, epoch, logs=None):
        if self.first_batch is None:
            self.first_batch = {"epoch": epoch}

    def on_train_batch_begin(self, batch, logs=None):
        if "batch" not in self.first_batch:
            self.first_batch["batch"] = batch

    def stream(self):
        step = self.start  # read when fit creates the iterator: after on_train_begin
        while True:
            yield batch_at(step)
            step += 1


class StepLog(keras.callbacks.Callback):
    """Appends one JSON line per step (scale, counters, learning rate); may stall; stops at TOTAL."""

    def __init__(self, path, stall_at=None):
        super().__init__()
        self.path = path
        self.stall_at = stall_at

    def on_train_batch_end(self, batch, logs=None):
        opt = self.model.optimizer
        step = steps_done(opt) - 1
        record = {
            "step": step,
            "loss_scale": float(opt.loss_scale.numpy()),
            "good_steps": int(opt.good_steps.numpy()),
            "skipped_steps": int(opt.skipped_steps.numpy()),
            "iterations": int(opt.iterations.numpy()),
            "learning_rate": float(np.asarray(opt.inner_optimizer.learning_rate)),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if step == self.stall_at:
            time.sleep(600)  # the test kills the process here, mid-epoch
        if step + 1 >= TOTAL:
            self.model.stop_training = True


def build(mode):
    """`o2`: float16 parameters with float32 master weights. `o1-accumulation`: float32 variables
    computing in float16 (mixed_float16), two micro-batches a step."""
    # float16 parameters: master weights matter
    keras.config.set_dtype_policy("float16" if mode == "o2" else "mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    if mode == "o2":
        arguments = dict(master_weights=True)
    else:
        arguments = dict(accumulation_steps=2)
    optimizer = kmix.wrap(keras.optimizers.Adam(1e-2), initial_scale=2.0**10, growth_interval=4, **arguments)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def final_state(model, position):
    """Every model and optimizer variable by path, and where this process resumed."""
    # By position, as Keras's weight files match them.
    arrays = {f"model/{i:03d}": v.numpy() for i, v in enumerate(model.variables)}
    arrays.update({f"optimizer/{i:03d}": v.numpy() for i, v in enumerate(model.optimizer.variables)})
    arrays["resumed_from_step"] = np.asarray(position.start)
    arrays["first_epoch"] = np.asarray(position.first_batch["epoch"])
    arrays["first_batch"] = np.asarray(position.first_batch["batch"])
    return arrays


def train(mode, backup, log, out, stall_at=None):
    """One run: `fit` until step `TOTAL` (or the stall), then every variable to `out`."""
    model = build(mode)
    position = DataPosition()
    data = tf.data.Dataset.from_generator(
        position.stream,
        output_signature=(
            tf.TensorSpec((BATCH, FEATURES), tf.float32),
            tf.TensorSpec((BATCH, 1), tf.float32),
        ),
    )
    callbacks = [
        kmix.callbacks.LearningRateWarmup(WARMUP_STEPS),
        keras.callbacks.BackupAndRestore(backup, save_freq=SAVE_FREQ),
        position,  # after BackupAndRestore: reads the restored counters
        StepLog(log, stall_at),
    ]
    model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, callbacks=callbacks, shuffle=False, verbose=0)
    np.savez(out, **final_state(model, position))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backup", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stall-at", type=int)
    parser.add_argument("--mode", choices=["o2", "o1-accumulation"], default="o2")
    parser.add_argument("--reference", metavar="PREFIX")
    args = parser.parse_args()
    tf.config.experimental.enable_op_determinism()
    if args.reference:
        train(args.mode, args.reference + "_backup", args.reference + ".jsonl", args.reference + ".npz")
    train(args.mode, args.backup, args.log, args.out, args.stall_at)


if __name__ == "__main__":
    main()
