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

    def __init__(self, steps, lines=10):
        super().__init__()
        self.steps, self.every = steps, max(1, math.ceil(steps / lines))

    def on_train_begin(self, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        step, logs = batch + 1, logs or {}
        if step % self.every == 0 or step == self.steps:
            scale = f"  loss scale {float(logs['loss_scale']):g}" if "loss_scale" in logs else ""
            progress(f"  step {step:>{len(str(self.steps))}}/{self.steps}  mean loss "
                     f"{float(logs.get('loss', float('nan'))):.4g}{scale}  ({time.perf_counter() - self._start:.1f} s)")


class _StepRecorder(keras.callbacks.Callback):
    """Records each step's own loss (`k * mean_k - (k - 1) * mean_(k-1)` from the running mean) and the loss scale."""

    def __init__(self):
        super().__init__()
        self.losses, self.scales, self._total = [], [], 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._total = 0.0

    def on_train_batch_end(self, batch, logs=None):
        total = float(logs["loss"]) * (batch + 1)
        self.losses.append(total - self._total)
        self._total, opt = total, self.model.optimizer
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
        data: `(x_train, y_train, x_test, y_test)`, at least `steps * BATCH` training sequences.
        verbose: Keras's progress bar (1), a line at the end (2), none (0), or `"compact"` (about ten lines).
        learning_rate: Adam's learning rate (after the warm-up).

    Returns:
        A dict: `losses` and `scales` per step, `final_loss` and `accuracy` (held out), `skipped_steps`,
        `final_scale` (None for float32), `seconds` and `first_nan_step` (1-based, or None).
    """
    x, y, x_test, y_test = data
    with kmix.policy_scope("float32" if run == "float32" else policy):
        model = build_model("kmix" if run == "kmix" else "naive")
        recorder = _StepRecorder()
        # Every run warms up the same way: warm-up alone does not cure the naive run.
        callbacks = [kmix.callbacks.LearningRateWarmup(max(1, steps // 10))]
        # Under mixed_float16, compile wraps the naive run's Adam in Keras's LossScaleOptimizer.
        optimizer = keras.optimizers.Adam(learning_rate)
        if run == "kmix":
            optimizer = kmix.wrap(optimizer)
            callbacks.append(kmix.callbacks.LossScaleMonitor())
        callbacks.append(recorder)
        if verbose == "compact":
            callbacks, verbose = callbacks + [_CompactProgress(steps)], 0
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        model.optimizer.build(model.trainable_variables)  # built in fit's first step, that step would trace twice
        start = time.perf_counter()
        model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, shuffle=False, verbose=verbose,
                  callbacks=callbacks)
        seconds = time.perf_counter() - start
        final_loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
        opt = model.optimizer
        scaled = isinstance(opt, keras.optimizers.LossScaleOptimizer)
        nan_steps = [i + 1 for i, v in enumerate(recorder.losses) if not math.isfinite(v)]
        applied = int(keras.ops.convert_to_numpy(opt.iterations))  # a skipped step does not advance it
        return {"losses": recorder.losses, "scales": recorder.scales, "final_loss": float(final_loss),
                "accuracy": float(accuracy), "skipped_steps": steps - applied,
                "final_scale": float(keras.ops.convert_to_numpy(opt.dynamic_scale)) if scaled else None,
                "seconds": seconds, "first_nan_step": nan_steps[0] if nan_steps else None}


def main(argv=None):
    """Runs the demo; prints the table and the PNG's path; returns `{run: train_run's dict, "plot": path}`.

    Example:
        >>> results = kmix.demo.main(["--steps", "40", "--quiet"])
        >>> results["naive"]["first_nan_step"]
        1
    """
    parser = argparse.ArgumentParser(prog="python -m kmix demo", description=(
        "Train a small transformer encoder on padded sequences three ways: float32, mixed precision with a "
        "hand-written -1e9 attention mask (goes NaN), and mixed precision with kmix. Prints a table and saves a "
        "PNG of the loss curves and the loss scale."))
    parser.add_argument("--steps", type=int, default=300, help=f"steps per run, batches of {BATCH} (default 300)")
    parser.add_argument("--policy", choices=["mixed_float16", "mixed_bfloat16"], default="mixed_float16", help="the "
                        "mixed runs' policy (default mixed_float16; -1e9 does not overflow in mixed_bfloat16)")
    parser.add_argument("--out", default="kmix-out", help="folder for the PNG, created if missing (default ./kmix-out)")
    parser.add_argument("--quiet", action="store_true", help="no progress output, only the table")
    parser.add_argument("--progress", choices=["auto", "bar", "compact"], default="auto", help="Keras's progress "
                        "bar, or about ten lines per run; auto (default): the bar on a terminal, else compact")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; received {args.steps}")
    data = (*make_data(args.steps * BATCH, seed=0), *make_data(1024, seed=1))
    titles = {"float32": "float32", "naive": f"{args.policy} with the hand-written (1 - mask) * -1e9 softmax",
              "kmix": f"{args.policy} with kmix (MaskedSoftmax, kmix.wrap, LossScaleMonitor)"}
    bar = args.progress == "bar" or (args.progress == "auto" and sys.stdout.isatty())
    verbose = 0 if args.quiet else 1 if bar else "compact"
    results = {}
    progress(f"Each run warms the learning rate up over its first {max(1, args.steps // 10)} steps.")
    for i, run in enumerate(RUNS, 1):
        progress(f"[{i}/{len(RUNS)}] {titles[run]}: {args.steps} steps")
        results[run] = train_run(run, args.policy, args.steps, data, verbose=verbose)
    print(f"\n{format_results(results, args.policy)}\n\n{summarize(results, args.policy)}")
    os.makedirs(args.out, exist_ok=True)
    results["plot"] = plot_results(results, args.policy, os.path.join(args.out, "demo.png"))
    print(f"\nLoss curves and loss scale saved to {os.path.abspath(results['plot'])}")
    print("Find such failures before training: python -m kmix diagnose --demo (kmix.diagnose(model, x, y)).")
    return results
