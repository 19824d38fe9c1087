"""The demo's three runs, trained on the same batches from the same weights, and its command line."""

import argparse
import math
import os
import sys
import time

import keras

import kmix
from kmix._output import progress
from kmix.demo.figure import plot_results
from kmix.demo.report import format_results, summarize
from kmix.demo.task import build_model, make_data

BATCH = 32
RUNS = ("float32", "naive", "kmix")


class _CompactProgress(keras.callbacks.Callback):
    """About ten lines per run: step, running loss and seconds so far (for logs, not terminals)."""

    def __init__(self, steps, lines=10, stream=None):
        super().__init__()
        self.steps, self.every = steps, max(1, math.ceil(steps / lines))
        self.stream = stream

    def on_train_begin(self, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        step = batch + 1
        if step % self.every and step != self.steps:
            return
        loss = float((logs or {}).get("loss", float("nan")))
        scale = f"  loss scale {float(logs['loss_scale']):g}" if logs and "loss_scale" in logs else ""
        print(f"  step {step:>{len(str(self.steps))}}/{self.steps}  mean loss {loss:.4g}{scale}  "
              f"({time.perf_counter() - self._start:.1f} s)", file=self.stream or sys.stderr, flush=True)


class _StepRecorder(keras.callbacks.Callback):
    """Records each step's own loss and the loss scale.

    Keras's batch logs hold the running mean of the epoch's losses; the
    step's loss is recovered as `k * mean_k - (k - 1) * mean_(k-1)`.
    """

    def __init__(self):
        super().__init__()
        self.losses, self.scales = [], []
        self._total = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._total = 0.0

    def on_train_batch_end(self, batch, logs=None):
        total = float(logs["loss"]) * (batch + 1)
        self.losses.append(total - self._total)
        self._total = total
        opt = self.model.optimizer
        if "loss_scale" in logs:
            self.scales.append(float(logs["loss_scale"]))
        elif isinstance(opt, keras.optimizers.LossScaleOptimizer):
            self.scales.append(float(keras.ops.convert_to_numpy(opt.dynamic_scale)))


def train_run(run, policy, steps, data, verbose=1, learning_rate=2e-3):
    """Trains one of the three runs for `steps` steps; returns its results.

    Args:
        run: `"float32"`, `"naive"` or `"kmix"`.
        policy: the mixed policy of the naive and kmix runs.
        steps: training steps, one batch of `BATCH` sequences each.
        data: `(x_train, y_train, x_test, y_test)`, at least `steps * BATCH`
            training sequences.
        verbose: Keras's progress bar (1), one line at the end (2), none
            (0), or `"compact"`: about ten short lines (for logs).
        learning_rate: Adam's learning rate (after the kmix run's warm-up).

    Returns:
        A dict: `losses` and `scales` per step (`scales` empty for float32),
        `final_loss` and `accuracy` on the held-out set, `skipped_steps`,
        `final_scale` (None for float32), `seconds` (training only),
        `first_nan_step` (1-based; None if the loss stayed finite).
    """
    x, y, x_test, y_test = data
    with kmix.policy_scope("float32" if run == "float32" else policy):
        model = build_model("kmix" if run == "kmix" else "naive")
        recorder = _StepRecorder()
        # Every run warms up the same way: warm-up alone does not cure the naive run.
        callbacks = [kmix.callbacks.LearningRateWarmup(max(1, steps // 10))]
        if run == "kmix":
            optimizer = kmix.wrap(keras.optimizers.Adam(learning_rate))
            callbacks.append(kmix.callbacks.LossScaleMonitor())
        else:
            # Under mixed_float16, compile wraps this in Keras's LossScaleOptimizer.
            optimizer = keras.optimizers.Adam(learning_rate)
        callbacks.append(recorder)
        if verbose == "compact":
            callbacks.append(_CompactProgress(steps))
            verbose = 0
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        n = steps * BATCH
        start = time.perf_counter()
        model.fit(x[:n], y[:n], batch_size=BATCH, epochs=1, shuffle=False, verbose=verbose, callbacks=callbacks)
        seconds = time.perf_counter() - start
        final_loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
        opt = model.optimizer
        scaled = isinstance(opt, keras.optimizers.LossScaleOptimizer)
        # A skipped step does not advance `iterations`, in Keras's optimizer as in kmix's.
        applied = int(keras.ops.convert_to_numpy(opt.iterations))
        nan_steps = [i + 1 for i, v in enumerate(recorder.losses) if not math.isfinite(v)]
        return {
            "losses": recorder.losses,
            "scales": recorder.scales,
            "final_loss": float(final_loss),
            "accuracy": float(accuracy),
            "skipped_steps": steps - applied,
            "final_scale": float(keras.ops.convert_to_numpy(opt.dynamic_scale)) if scaled else None,
            "seconds": seconds,
            "first_nan_step": nan_steps[0] if nan_steps else None,
        }


def main(argv=None):
    """Runs the demo; prints the table and the PNG's path; returns the results.

    Args:
        argv: command-line arguments (`--help` lists them); `sys.argv` by default.

    Returns:
        `{"float32": ..., "naive": ..., "kmix": ...}`, each the dict of
        `train_run`, plus `"plot"`: the PNG's path.

    Example:
        >>> results = kmix.demo.main(["--steps", "40", "--quiet"])
        >>> results["naive"]["first_nan_step"]
        1
    """
    parser = argparse.ArgumentParser(
        prog="python -m kmix demo",
        description="Train a small transformer encoder on padded sequences three ways: float32, "
        "mixed precision with a hand-written -1e9 attention mask (goes NaN), and mixed precision "
        "with kmix. Prints a table and saves a PNG of the loss curves and the loss scale.",
    )
    parser.add_argument("--steps", type=int, default=300,
                        help="training steps per run, batches of %d sequences (default 300)" % BATCH)
    parser.add_argument("--policy", choices=["mixed_float16", "mixed_bfloat16"], default="mixed_float16",
                        help="policy of the two mixed-precision runs (default mixed_float16; "
                        "under mixed_bfloat16 the -1e9 mask does not overflow)")
    parser.add_argument("--out", default="kmix-out",
                        help="folder for the PNG, created if missing (default ./kmix-out)")
    parser.add_argument("--quiet", action="store_true", help="no progress output, only the table")
    parser.add_argument("--progress", choices=["auto", "bar", "compact"], default="auto",
                        help="Keras's progress bar, or about ten short lines per run; auto (the "
                        "default): the bar on a terminal, compact lines when output is piped")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; received {args.steps}")
    x, y = make_data(args.steps * BATCH, seed=0)
    x_test, y_test = make_data(1024, seed=1)
    data = (x, y, x_test, y_test)
    results = {}
    titles = {
        "float32": "float32",
        "naive": f"{args.policy} with the hand-written (1 - mask) * -1e9 softmax",
        "kmix": f"{args.policy} with kmix (MaskedSoftmax, kmix.wrap, LossScaleMonitor)",
    }
    if args.quiet:
        verbose = 0
    elif args.progress == "bar" or (args.progress == "auto" and sys.stdout.isatty()):
        verbose = 1
    else:
        verbose = "compact"
    progress(f"Each run warms the learning rate up over its first {max(1, args.steps // 10)} steps.")
    for i, run in enumerate(RUNS, 1):
        progress(f"[{i}/{len(RUNS)}] {titles[run]}: {args.steps} steps")
        results[run] = train_run(run, args.policy, args.steps, data, verbose=verbose)
    print()
    print(format_results(results, args.policy))
    print()
    print(summarize(results, args.policy))
    os.makedirs(args.out, exist_ok=True)
    path = plot_results(results, args.policy, os.path.join(args.out, "demo.png"))
    print(f"\nLoss curves and loss scale saved to {os.path.abspath(path)}")
    print("Find such failures before training: python -m kmix diagnose --demo (kmix.diagnose(model, x, y)).")
    results["plot"] = path
    return results
