"""`python -m kmix demo`: the classic float16 NaN, trained three ways side by side.

A small transformer encoder classifies variable-length, zero-padded token
sequences (generated in this module; nothing is downloaded). The same model,
from the same initial weights, on the same batches, is trained:

1. `float32`: the reference;
2. `mixed_float16` with the attention mask users write by hand,
   `scores + (1 - mask) * -1e9` after casting the mask to the scores' dtype:
   in float16 `-1e9` is `-inf` and `0 * -inf` is NaN, so the loss is NaN;
3. `mixed_float16` with kmix: `kmix.layers.MaskedSoftmax` (a float32 softmax
   that takes the boolean mask), `kmix.wrap` on the optimizer and the
   `LossScaleMonitor` callback.

All three warm the learning rate up with `kmix.callbacks.LearningRateWarmup`
over the first tenth of the steps: warm-up alone does not cure the NaN.

It prints a table (final loss and accuracy on held-out sequences, skipped
steps, final loss scale, training time, first NaN step) and saves a PNG of
the per-step training loss and the loss scale of both mixed runs. On a
terminal each run shows Keras's progress bar; when the output goes to a file
or a CI log, a few compact lines instead (`--progress` chooses).
"""

import argparse
import math
import os
import sys
import time

import keras
import numpy as np

import kmix
from kmix._output import format_table, progress

VOCAB = 48  # token 0 is padding; 1..CLASSES are the markers; the rest are distractors
CLASSES = 6
MAX_LEN = 64
MIN_LEN = 6
BATCH = 32
RUNS = ("float32", "naive", "kmix")


def make_data(n, seed):
    """`n` padded sequences and their labels: which marker token occurs most often.

    Each sequence has a length in [MIN_LEN, MAX_LEN] and random distractor
    tokens; every marker occurs zero or one time, except the label's, which
    occurs once more than the most frequent other marker, so the label is
    always a strict majority. Padding (token 0) fills the rest, and the model
    must ignore it: only the masks keep it out of attention and pooling.

    Returns:
        `(tokens, labels)`: int32 arrays of shapes `(n, MAX_LEN)` and `(n,)`.
    """
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n, MAX_LEN), np.int32)
    labels = rng.integers(0, CLASSES, size=n).astype(np.int32)
    for i in range(n):
        counts = rng.integers(0, 2, size=CLASSES)
        counts[labels[i]] = counts.max() + 1
        markers = np.repeat(np.arange(1, CLASSES + 1), counts)
        length = rng.integers(max(MIN_LEN, len(markers)), MAX_LEN + 1)
        seq = rng.integers(CLASSES + 1, VOCAB, size=length)
        seq[rng.choice(length, size=len(markers), replace=False)] = markers
        tokens[i, :length] = seq
    return tokens, labels


def build_model(softmax, d_model=64, heads=4, layers=2, seed=0):
    """The encoder classifier under the current Keras dtype policy.

    Args:
        softmax: `"naive"` for the hand-written additive `-1e9` mask,
            `"kmix"` for `kmix.layers.MaskedSoftmax` with the boolean mask.
        d_model, heads, layers: the encoder's width, heads and depth.
        seed: the initial weights' seed (the same for every run).

    Returns:
        An uncompiled functional `keras.Model` from token ids to class
        probabilities (float32).
    """
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((MAX_LEN,), dtype="int32", name="tokens")
    mask = keras.ops.not_equal(tokens, 0)
    x = keras.layers.Embedding(VOCAB, d_model, name="embed")(tokens)
    x = _PositionEmbedding(name="position")(x)
    for i in range(layers):
        h = keras.layers.LayerNormalization(name=f"ln_a{i}")(x)
        x = x + _Attention(d_model, heads, softmax, name=f"attention{i}")(h, mask)
        h = keras.layers.LayerNormalization(name=f"ln_f{i}")(x)
        h = keras.layers.Dense(2 * d_model, activation="gelu", name=f"ff_in{i}")(h)
        x = x + keras.layers.Dense(d_model, name=f"ff_out{i}")(h)
    x = keras.layers.LayerNormalization(name="ln_out")(x)
    x = _MaskedMean(name="pool")(x, mask)
    outputs = keras.layers.Dense(CLASSES, activation="softmax", dtype="float32", name="classes")(x)
    return keras.Model(tokens, outputs, name=f"encoder_{softmax}")


class _Attention(keras.layers.Layer):
    """Self-attention written out, with the softmax the run asks for."""

    def __init__(self, d_model, heads, softmax, **kwargs):
        super().__init__(**kwargs)
        self.d_model, self.heads, self.softmax = d_model, heads, softmax
        self.qkv = keras.layers.Dense(3 * d_model, name="qkv")
        self.out = keras.layers.Dense(d_model, name="out")
        self.masked_softmax = kmix.layers.MaskedSoftmax(axis=-1, name="softmax")

    def call(self, x, mask):
        ops = keras.ops
        b, t, head_dim = ops.shape(x)[0], ops.shape(x)[1], self.d_model // self.heads
        qkv = ops.reshape(self.qkv(x), (b, t, 3, self.heads, head_dim))
        q, k, v = (ops.transpose(qkv[:, :, j], (0, 2, 1, 3)) for j in range(3))
        scores = ops.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(head_dim)
        keep = mask[:, None, None, :]
        if self.softmax == "naive":
            # What tutorials write; in float16, -1e9 is -inf and 0 * -inf is NaN.
            keep = ops.cast(keep, scores.dtype)
            probs = ops.softmax(scores + (1.0 - keep) * -1e9, axis=-1)
        else:
            probs = self.masked_softmax(scores, mask=keep)
        out = ops.einsum("bhqk,bhkd->bqhd", probs, v)
        return self.out(ops.reshape(out, (b, t, self.d_model)))


class _PositionEmbedding(keras.layers.Layer):
    """Adds a trained embedding of each position."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="embeddings")

    def call(self, x):
        return x + self.table[None]


class _MaskedMean(keras.layers.Layer):
    """Mean over the unpadded positions."""

    def call(self, x, mask):
        keep = keras.ops.cast(mask, x.dtype)[..., None]
        return keras.ops.sum(x * keep, axis=1) / keras.ops.maximum(keras.ops.sum(keep, axis=1), 1)


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


def format_results(results, policy):
    """The results as the demo's table (a string)."""
    names = {"float32": "float32", "naive": f"{policy}, -1e9 mask", "kmix": f"{policy}, kmix"}
    rows = []
    for run, r in results.items():
        rows.append([
            names[run],
            _number(r["final_loss"]),
            f"{r['accuracy']:.3f}",
            r["skipped_steps"] if r["final_scale"] is not None else "-",
            _number(r["final_scale"]) if r["final_scale"] is not None else "-",
            f"{r['seconds']:.1f} s",
            r["first_nan_step"] if r["first_nan_step"] is not None else "none",
        ])
    headers = ["run", "final loss", "accuracy", "skipped steps", "final scale", "time", "first NaN step"]
    return format_table(headers, rows)


def summarize(results, policy):
    """A few sentences saying what the table shows."""
    f32, naive, ours = results["float32"], results["naive"], results["kmix"]
    lines = []
    if naive["first_nan_step"] is not None:
        scale = "" if naive["final_scale"] is None else f"; the loss scale fell to {naive['final_scale']:g}"
        lines.append(
            f"{policy} with the hand-written -1e9 mask: the loss is NaN from step "
            f"{naive['first_nan_step']}, {naive['skipped_steps']} of {len(naive['losses'])} steps "
            f"skipped{scale}."
        )
    else:
        lines.append(
            f"{policy} with the hand-written -1e9 mask stayed finite: -1e9 fits in "
            f"{'bfloat16 (float32 range)' if 'bfloat16' in policy else 'this dtype'}."
        )
    lines.append(
        f"{policy} with kmix: final loss {_number(ours['final_loss'])}, accuracy "
        f"{ours['accuracy']:.3f}; float32: {_number(f32['final_loss'])}, {f32['accuracy']:.3f}."
    )
    lines.append(
        "Times are this machine's, for a model too small to show speed; `python -m kmix doctor` "
        "measures the fastest safe route here and `python -m kmix bench train` compares every route."
    )
    return "\n".join(lines)


def _number(value):
    if value is None or not math.isfinite(value):
        return str(value)
    return f"{value:.4g}"


def headline(results, policy):
    """The figure's title: what the three runs show, in one line."""
    f32, naive, ours = results["float32"], results["naive"], results["kmix"]
    if naive["first_nan_step"] is not None:
        left = f"{policy} with a -1e9 mask: NaN from step {naive['first_nan_step']}"
    else:
        left = f"{policy} with a -1e9 mask: stays finite"
    if ours["first_nan_step"] is None and math.isfinite(ours["final_loss"]):
        right = (f"with kmix: trains like float32 (held-out loss {_number(ours['final_loss'])} "
                 f"vs {_number(f32['final_loss'])})")
    else:
        right = f"with kmix: NaN from step {ours['first_nan_step']}"
    return f"{left}; {right}"


def plot_results(results, policy, path):
    """Saves `figure(results, policy)` as a PNG at `path`; returns `path`."""
    import matplotlib.pyplot as plt

    fig = figure(results, policy)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figure(results, policy):
    """The demo's matplotlib figure: per-step losses and both mixed runs' loss scales.

    Three panels: the training loss of every run (a run that is NaN throughout
    appears as a marker at its first NaN step, not as a legend entry with no
    line); kmix's loss scale on a log2 axis fitted to its own range, with the
    skipped steps marked; the naive run's scale (Keras's LossScaleOptimizer)
    on a log axis that reaches down as far as it falls. The title states the
    conclusion.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_ours, ax_naive) = plt.subplots(
        1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1.4, 1, 1]}
    )
    labels = {"float32": "float32", "naive": f"{policy}, -1e9 mask", "kmix": f"{policy}, kmix"}
    colors = {"float32": "tab:blue", "naive": "tab:red", "kmix": "tab:green"}
    finite_losses = []
    for run, r in results.items():
        losses = np.asarray(r["losses"], dtype=float)
        steps = np.arange(1, len(losses) + 1)
        finite = np.isfinite(losses)
        if finite.any():
            finite_losses.append(losses[finite])
            # float32 wide and underneath: where kmix tracks it exactly, both stay visible.
            wide = run == "float32"
            ax_loss.plot(steps, np.where(finite, losses, np.nan), color=colors[run], label=labels[run],
                         linewidth=3 if wide else 1, alpha=0.5 if wide else 1.0, zorder=1 if wide else 2)
        if r["first_nan_step"] is not None:
            always = "" if finite.any() else " on (no finite loss: no line)"
            ax_loss.axvline(r["first_nan_step"], color=colors[run], linestyle=":", linewidth=2,
                            label=f"{labels[run]}: NaN from step {r['first_nan_step']}{always}")
    if finite_losses:
        ax_loss.set_ylim(0, max(v.max() for v in finite_losses) * 1.15)  # room for the legend
    ax_loss.set(title="training loss per step", xlabel="step", ylabel="loss")
    ax_loss.legend(fontsize=8, loc="upper right")

    _plot_kmix_scale(ax_ours, results["kmix"], colors["kmix"], labels["kmix"])
    _plot_naive_scale(ax_naive, results["naive"], colors["naive"], labels["naive"])
    fig.suptitle(headline(results, policy), fontsize=12, fontweight="bold")
    fig.tight_layout()
    return fig


def _plot_kmix_scale(ax, r, color, label):
    scales = np.asarray(r["scales"], dtype=float)
    steps = np.arange(1, len(scales) + 1)
    ax.set(title="kmix: loss scale (kmix.wrap)", xlabel="step", ylabel="loss scale")
    if not len(scales):
        return
    ax.step(steps, scales, where="post", color=color, label=label)
    drops = steps[1:][scales[1:] < scales[:-1]]
    if len(drops):
        ax.plot(drops, scales[drops - 1], "v", color="black", markersize=5,
                label=f"overflow: step skipped, scale halved ({len(drops)}x)")
    ax.set_yscale("log", base=2)
    low, high = np.log2(scales[scales > 0].min()), np.log2(scales.max())
    ax.set_ylim(2 ** (np.floor(low) - 2), 2 ** (np.ceil(high) + 2))
    ax.text(0.02, 0.04, f"{r['skipped_steps']} of {len(scales)} steps skipped; final scale "
            f"{r['final_scale']:g}", transform=ax.transAxes, fontsize=8)
    ax.legend(fontsize=8, loc="upper right")


def _plot_naive_scale(ax, r, color, label):
    scales = np.asarray(r["scales"], dtype=float)
    ax.set(title="naive run: Keras's loss scale", xlabel="step", ylabel="loss scale (log)")
    if not len(scales):
        ax.text(0.5, 0.5, "no loss scale (not float16)", ha="center", transform=ax.transAxes)
        return
    steps = np.arange(1, len(scales) + 1)
    ax.plot(steps, np.where(scales > 0, scales, np.nan), color=color, label=label)
    ax.set_yscale("log")
    ax.set_xlim(0, len(scales) + 1)
    note = f"{r['skipped_steps']} of {len(scales)} steps skipped"
    if r["skipped_steps"] == len(scales):
        note += ",\nthe scale halved on each"
    if (scales <= 0).any():
        zero = int(np.argmax(scales <= 0)) + 1
        ax.axvline(zero, color=color, linestyle=":", label=f"scale 0 (below float32's range) from step {zero}")
    ax.text(0.98, 0.04, note, transform=ax.transAxes, fontsize=8, ha="right")
    ax.legend(fontsize=8, loc="upper right")


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
