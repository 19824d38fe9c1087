"""The program tests/distribute/test_multi_worker_fit.py runs: `model.fit` under a strategy.

`--strategy multi_worker`: one of two `MultiWorkerMirroredStrategy` workers
(its `TF_CONFIG` says which), with `kmix.distribute.enable_multi_worker_fit()`.
`--strategy mirrored`: the reference, one process with `MirroredStrategy` over
two logical CPUs. Both see the same global batches: a `tf.data.Dataset` of
batches of `GLOBAL_BATCH` rows, split in halves (a worker's or a replica's).

`--scenario all` trains these models one after the other and writes
`<out>/<strategy><index>.npz`:
- `kmix_*`: mixed_float16, `kmix.wrap(Adam)`, `validation_data` (arrays), a
  last partial batch, an inf in worker 1's half of one batch; then `evaluate`
  and `predict` (with a partial last batch).
- `steps2_*`: the `kmix_*` fit, `evaluate` and `predict` again with
  `steps_per_execution=2` (three executions of two steps, the last one with
  the partial batch).
- `subclass_*`: the same fit with a user subclass of Keras's own
  `LossScaleOptimizer` (it changes only the default initial scale, so it runs
  every line of Keras's class and of kmix's wrapper of its `apply`).
- `fit_float16_*`: the `kmix_*` fit with `allreduce_dtype="float16"`;
  `loop_bfloat16_*`: a custom loop over the five full batches with
  `allreduce_dtype="bfloat16"`; `loop_float32_*` (the reference process only):
  that loop with float32 sums.
- `backup_*` (with `--backup-root`): `EPOCHS` epochs with
  `BackupAndRestore(save_freq="epoch")`.
`--scenario backup` (with `--backup-root`) trains only the last one, without calling
`enable_multi_worker_fit` (`kmix.wrap` in the strategy's scope does);
`--die-at EPOCH:BATCH` makes worker 1 SIGKILL itself after that batch (its
backup is the end of the epoch before).
"""

import argparse
import faulthandler
import json
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

FEATURES, GLOBAL_BATCH = 6, 8
TRAIN_ROWS, VAL_ROWS, PREDICT_ROWS = 44, 20, 20  # 44 = 5 full batches + a partial one of 4
OVERFLOW_ROW = 2 * GLOBAL_BATCH + GLOBAL_BATCH // 2 + 1  # batch 2, in the second half (worker 1)
EPOCHS = 3


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(TRAIN_ROWS + VAL_ROWS + PREDICT_ROWS, FEATURES)).astype("float32")
    y = (x[:, :3].sum(axis=1, keepdims=True) - x[:, 3:4]).astype("float32")
    train = (x[:TRAIN_ROWS].copy(), y[:TRAIN_ROWS])
    train[0][OVERFLOW_ROW, 0] = np.inf
    val = (x[TRAIN_ROWS:TRAIN_ROWS + VAL_ROWS], y[TRAIN_ROWS:TRAIN_ROWS + VAL_ROWS])
    return train, val, x[TRAIN_ROWS + VAL_ROWS:]


def batches(x, y=None):
    tensors = x if y is None else (x, y)
    return tf.data.Dataset.from_tensor_slices(tensors).batch(GLOBAL_BATCH)


def build_model(keras):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


def optimizer_state(keras, prefix, model, optimizer):
    state = {f"{prefix}_w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    for name in ("iterations", "dynamic_scale", "skipped_steps", "step_counter"):
        if hasattr(optimizer, name):  # Keras's own LossScaleOptimizer has no skipped_steps
            state[f"{prefix}_{name}"] = np.asarray(keras.ops.convert_to_numpy(getattr(optimizer, name)))
    return state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["multi_worker", "mirrored"], required=True)
    parser.add_argument("--scenario", choices=["all", "backup"], default="all")
    parser.add_argument("--out", required=True)
    parser.add_argument("--backup-root")
    parser.add_argument("--die-at", default="")
    args = parser.parse_args()
    if args.scenario == "backup" and not args.backup_root:
        parser.error("--scenario backup needs --backup-root")
    if os.environ.get("STACKS_AFTER"):  # a hang shows where it hangs in the worker's log
        faulthandler.dump_traceback_later(float(os.environ["STACKS_AFTER"]), exit=False)

    if args.strategy == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import kmix

    tf.config.experimental.enable_op_determinism()
    keras.config.set_dtype_policy("mixed_float16")
    if args.scenario == "all":
        # Also in the reference: it makes Keras's own LossScaleOptimizer decide on all replicas.
        kmix.distribute.enable_multi_worker_fit()
    # --scenario backup relies on kmix.wrap, called in the strategy's scope, to enable it.
    if args.strategy == "multi_worker":
        index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        index = 0
        strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    (x, y), (xv, yv), xp = data()
    state = {}

    class SubclassedLSO(keras.optimizers.LossScaleOptimizer):
        """A user's subclass of Keras's class, with another default initial scale."""

        def __init__(self, inner_optimizer, **kwargs):
            kwargs.setdefault("initial_scale", 2.0**8)
            super().__init__(inner_optimizer, **kwargs)

    def fit(prefix, make_optimizer, steps_per_execution=1, **kwargs):
        with strategy.scope():
            model = build_model(keras)
            model.compile(
                optimizer=make_optimizer(keras.optimizers.Adam(1e-2)),
                loss="mse",
                steps_per_execution=steps_per_execution,
            )
        history = model.fit(batches(x, y), epochs=1, verbose=0, **kwargs)
        state.update(optimizer_state(keras, prefix, model, model.optimizer))
        state[f"{prefix}_loss"] = np.asarray(history.history["loss"])
        if "validation_data" in kwargs:
            state[f"{prefix}_val_loss"] = np.asarray(history.history["val_loss"])
        print(f"{args.strategy} {index}: {prefix} done", flush=True)
        return model

    def custom_loop(prefix, allreduce_dtype):
        """The same batches in a custom loop (`strategy.run`, `scale_loss`, `apply`)."""
        with strategy.scope():
            model = build_model(keras)
            optimizer = kmix.wrap(keras.optimizers.Adam(1e-2), initial_scale=2.0**10, allreduce_dtype=allreduce_dtype)
            optimizer.build(model.trainable_variables)

        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                per_example = keras.losses.mean_squared_error(yb, model(xb, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
                scaled = optimizer.scale_loss(loss)
            optimizer.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

        # No autograph (step_fn has no tensor-dependent Python control flow): converting kmix's and
        # Keras's code for it costs seconds of CPU once per process.
        step = tf.function(lambda batch: strategy.run(step_fn, args=batch), autograph=False)
        # Full batches only: compute_average_loss divides by the global batch size.
        for batch in strategy.experimental_distribute_dataset(batches(x[:40], y[:40])):
            step(batch)
        state.update(optimizer_state(keras, prefix, model, optimizer))
        print(f"{args.strategy} {index}: {prefix} done", flush=True)

    if args.scenario == "all":
        for prefix, steps in (("kmix", 1), ("steps2", 2)):
            # initial_scale 2^10: the injected inf is the only overflow (2^15 overflows once more).
            model = fit(
                prefix,
                lambda opt: kmix.wrap(opt, initial_scale=2.0**10),
                steps_per_execution=steps,
                validation_data=(xv, yv),
            )
            state[f"{prefix}_evaluate"] = np.asarray(model.evaluate(batches(xv, yv), verbose=0))
            print(f"{args.strategy} {index}: evaluate done", flush=True)
            state[f"{prefix}_predict"] = model.predict(batches(xp), verbose=0)
            print(f"{args.strategy} {index}: predict done", flush=True)
            if prefix == "kmix":
                state["kmix_direct"] = keras.ops.convert_to_numpy(model(xp))
                print(f"{args.strategy} {index}: direct call done", flush=True)
        fit("subclass", SubclassedLSO)
        # allreduce_dtype: float16 (with its wire scaling) through fit, bfloat16 through a custom loop.
        fit("fit_float16", lambda opt: kmix.wrap(opt, initial_scale=2.0**10, allreduce_dtype="float16"))
        custom_loop("loop_bfloat16", "bfloat16")
        if args.strategy == "mirrored":  # the float32-reduced loop: the same sums on either strategy
            custom_loop("loop_float32", None)
    if args.backup_root:  # the test asks for it under KMIX_FULL_TESTS=1 only
        state.update(fit_with_backup(keras, kmix, strategy, args, index, x, y))
    write(args.out, args.strategy, index, state)


def fit_with_backup(keras, kmix, strategy, args, index, x, y):
    """`backup_*`: `EPOCHS` epochs with `BackupAndRestore`; worker 1 may die (`--die-at`)."""
    die_epoch, die_batch = (int(v) for v in args.die_at.split(":")) if args.die_at else (-1, -1)
    if index != 1:  # only worker 1 dies; worker 0 then waits in a collective until killed
        die_epoch = die_batch = -1

    class Die(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            print(f"{args.strategy} {index}: epoch {epoch} begins", flush=True)

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (die_epoch, die_batch):
                print(f"{args.strategy} {index}: dying at {self.epoch}:{batch}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    with strategy.scope():
        model = build_model(keras)
        model.compile(optimizer=kmix.wrap(keras.optimizers.Adam(1e-2)), loss="mse")
    # One directory per worker (and one for the reference process): each writes its own copy.
    backup = os.path.join(args.backup_root, f"{args.strategy}{index}")
    callbacks = [keras.callbacks.BackupAndRestore(backup, save_freq="epoch"), Die()]
    model.fit(batches(x, y), epochs=EPOCHS, verbose=0, callbacks=callbacks)
    print(f"{args.strategy} {index}: enabled {kmix.distribute.multi_worker_fit_enabled()}", flush=True)
    return optimizer_state(keras, "backup", model, model.optimizer)


def write(out, strategy, index, state):
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, f"{strategy}{index}.npz"), **state)
    print(f"{strategy} {index}: wrote results", flush=True)
    if strategy == "multi_worker":
        wait_for_peer(out, index)


def wait_for_peer(folder, index):
    """Exits only once the other worker is done too.

    A worker that exits while its peer still pulls the last collective's
    buffer from it makes that peer fail ("Socket closed"); a worker writes its
    file only after its own last collective, so waiting for it is enough.
    """
    open(os.path.join(folder, f"done{index}"), "w").close()
    other = os.path.join(folder, f"done{1 - index}")
    while not os.path.exists(other):  # the test's hard deadline bounds this
        time.sleep(0.1)


if __name__ == "__main__":
    main()
