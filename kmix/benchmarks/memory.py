"""`python -m kmix bench memory`: what each memory lever saves on a GPT-style model.

One row per configuration, each built, trained and measured alone:

- `float32`: Keras AdamW, float32 everything (the baseline of the ratios);
  every row uses AdamW with `beta_2=0.99` (the figures in docs/benchmarks.md were taken so);
- `O1`: kmix mixed precision (float32 parameters, float16 compute, `kmix.wrap`);
- `O1 bfloat16`: the same with bfloat16 compute (the route `kmix.recommend`
  picks on a CPU with AVX512_BF16): its peak against float32's is the CPU's
  memory saving at the same batch;
- `O1 + accum x2`: gradient accumulation over 2 micro-batches of half the
  batch (one optimizer step = 2 micro-batches, the same samples per step);
- `O1 + remat`: `kmix.layers.Remat` around every transformer block;
- `O1 + accum x2 + remat`: all three;
- `O2 masters`: bfloat16 parameters with float32 master weights;
- `O2 kahan`: bfloat16 parameters with `master_weights="kahan"`.

`peak` is the peak of TensorFlow's allocator statistics
(`tf.config.experimental.get_memory_info`) on the device that runs the step
(the first GPU, or the CPU) over one optimizer step, reset just before it:
it includes what stays allocated between steps (weights, optimizer state)
and the step's activations and gradients. `state` is what is allocated
between steps; `state (report)` is what `kmix.memory_report` predicts for
it (parameters, master weights, optimizer slots; plus the float32
accumulators of the accumulation rows). `ms/step` is the median time of one
optimizer step; `loss` the training loss of the last step (every row
trains on the same batch for the same number of steps, so the losses are
close; the accumulation rows show their last micro-batch's).
"""

import argparse
import gc
import os
import time

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix import _compat
from kmix.benchmarks.common import format_table, median, progress, time_call
from kmix.benchmarks.gpt import PositionEmbedding

CONFIGS = (
    # name, policy, half, accumulation, remat, master_weights
    ("float32", "float32", None, 1, False, None),
    ("O1", "O1", "float16", 1, False, "auto"),
    ("O1 bfloat16", "O1", "bfloat16", 1, False, "auto"),
    ("O1 + accum x2", "O1", "float16", 2, False, "auto"),
    ("O1 + remat", "O1", "float16", 1, True, "auto"),
    ("O1 + accum x2 + remat", "O1", "float16", 2, True, "auto"),
    ("O2 masters", "O2", "bfloat16", 1, False, True),
    ("O2 kahan", "O2", "bfloat16", 1, False, "kahan"),
)
HEADERS = ["configuration", "peak", "state", "state (report)", "ms/step", "peak x f32", "time x f32", "loss"]


class Block(keras.layers.Layer):
    """A pre-norm GPT block: causal self-attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, d_model, heads, **kwargs):
        super().__init__(**kwargs)
        self.d_model, self.heads = d_model, heads
        self.ln_attn = keras.layers.LayerNormalization(epsilon=1e-5, dtype=self.dtype_policy)
        self.attention = kmix.layers.MultiHeadAttention(heads, d_model // heads, dtype=self.dtype_policy)
        self.ln_mlp = keras.layers.LayerNormalization(epsilon=1e-5, dtype=self.dtype_policy)
        self.mlp_in = keras.layers.Dense(4 * d_model, activation="gelu", dtype=self.dtype_policy)
        self.mlp_out = keras.layers.Dense(d_model, dtype=self.dtype_policy)

    def call(self, x, training=None):
        h = self.ln_attn(x)
        x = x + self.attention(h, h, use_causal_mask=True, training=training)
        return x + self.mlp_out(self.mlp_in(self.ln_mlp(x)))

    def get_config(self):
        return {**super().get_config(), "d_model": self.d_model, "heads": self.heads}


def build_model(layers, d_model, heads, seq, vocab, remat):
    """The GPT-style model of `bench train`, with each block one `Block` layer (wrapped if `remat`)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, d_model, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    for i in range(layers):
        block = Block(d_model, heads, name=f"block{i}")
        x = (kmix.layers.Remat(block, name=f"remat{i}") if remat else block)(x)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_final")(x)
    logits = keras.layers.Dense(vocab, name="lm_head")(x)
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(logits)
    return keras.Model(tokens, logits, name="gpt_blocks")


def use_a_cpu_allocator_with_statistics():
    """Makes TensorFlow's CPU allocator keep the statistics `measure` reads; returns which one it is.

    With oneDNN on, its allocator keeps them (and sees no tensor under
    256 KiB). Without it, TensorFlow's default CPU allocator keeps none, so
    the BFC allocator is asked for (`TF_CPU_ALLOCATOR_USE_BFC`), which sees
    every tensor and rounds its chunks up. That variable is read when
    TensorFlow's runtime starts: here it works only before the first op.
    """
    if _compat.onednn_enabled():
        return "oneDNN's (tensors under 256 KiB not seen)"
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    return "BFC (every tensor, chunks rounded up)"


def device_name():
    """The device whose allocator is measured: `"GPU:0"` if there is one, else `"CPU:0"`."""
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


def measure(config, size, steps, jit_compile):
    """Builds, trains and measures one configuration alone; returns its figures as a dict."""
    name, policy, half, accumulation, remat, master_weights = config
    keras.backend.clear_session()
    gc.collect()
    device = device_name()
    spec = kmix.Policy(policy, half=half) if half else kmix.Policy(policy)
    try:
        baseline = tf.config.experimental.get_memory_info(device)["current"]
    except ValueError as e:  # TensorFlow started before use_a_cpu_allocator_with_statistics
        raise RuntimeError(
            f"TensorFlow's allocator on {device} keeps no statistics ({e}). Run the benchmark in a "
            "new process (`python -m kmix bench memory`), or set TF_CPU_ALLOCATOR_USE_BFC=true (or "
            "TF_ENABLE_ONEDNN_OPTS=1) in the environment before Python starts."
        ) from None
    with tf.device(device), kmix.policy_scope(spec):
        model = build_model(size["layers"], size["d_model"], size["heads"], size["seq"], size["vocab"], remat)
        # beta_2 = 0.99: Keras's default 0.999 is 1.0 in bfloat16, where the "kahan" row's
        # Adam computes (see `kmix.LossScaleOptimizer`); the same for every row.
        optimizer = keras.optimizers.AdamW(1e-4, beta_2=0.99)
        if master_weights is not None:
            optimizer = kmix.wrap(optimizer, master_weights=master_weights, accumulation_steps=accumulation)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit_compile)
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, size["vocab"], size=(size["batch"], size["seq"] + 1)).astype(np.int32)
        micro = size["batch"] // accumulation
        batches = [(tf.constant(tokens[i * micro:(i + 1) * micro, :-1]), tf.constant(tokens[i * micro:(i + 1) * micro, 1:]))
                   for i in range(accumulation)]
        losses = []

        def step():  # one optimizer step: `accumulation` micro-batches
            for x, y in batches:
                losses.append(float(model.train_on_batch(x, y)))

        step()
        step()  # traced, optimizer built
        gc.collect()
        state = tf.config.experimental.get_memory_info(device)["current"] - baseline
        tf.config.experimental.reset_memory_stats(device)
        step()
        peak = tf.config.experimental.get_memory_info(device)["peak"] - baseline
        seconds = median(time_call(step, repeats=steps, warmup=0))
    report = predicted_state(model, spec, master_weights, accumulation)
    del model, optimizer
    return {"name": name, "peak_bytes": peak, "state_bytes": state, "report_state_bytes": report,
            "step_seconds": seconds, "loss": losses[-1]}


def predicted_state(model, spec, master_weights, accumulation):
    """What `kmix.memory_report` says stays allocated between steps: params, masters, slots, accumulators."""
    report = kmix.memory_report(model, spec, "adamw", master_weights=master_weights)
    row = next(iter(report.values()))
    accumulators = 4 * report.num_params if accumulation > 1 else 0
    return row["params"] + row["master_weights"] + row["optimizer_slots"] + accumulators


def format_rows(results):
    """Table rows; the ratios are against the `float32` row."""
    base = next((r for r in results if r["name"] == "float32"), None)
    rows = []
    for r in results:
        rows.append([
            r["name"], _mib(r["peak_bytes"]), _mib(r["state_bytes"]), _mib(r["report_state_bytes"]),
            r["step_seconds"] * 1e3,
            r["peak_bytes"] / base["peak_bytes"] if base else "n/a",
            r["step_seconds"] / base["step_seconds"] if base else "n/a",
            r["loss"],
        ])
    return rows


def _mib(n):
    return f"{n / 2**20:.2f} MiB"


_LEVEL_COLORS = {"float32": "tab:gray", "O1 (float32 parameters)": "tab:blue",
                 "O2 (half parameters)": "tab:green"}


def _level(name):
    """The legend entry of a configuration's bar, from its name (`"O1 + remat"`, `"O2 kahan"`)."""
    if name.startswith("O1"):
        return "O1 (float32 parameters)"
    return "O2 (half parameters)" if name.startswith("O2") else "float32"


def plot(results, path, title):
    """Saves peak memory and step time per configuration, as ratios to float32, as a PNG bar chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results[0]
    names = [r["name"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, label in ((axes[0], "peak_bytes", "peak memory / float32"),
                           (axes[1], "step_seconds", "step time / float32")):
        values = [r[key] / base[key] for r in results]
        bars = ax.bar(range(len(results)), values, color=[_LEVEL_COLORS[_level(n)] for n in names])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(results)), names, rotation=30, ha="right", fontsize=8)
        ax.set(ylabel=label, ylim=(0, max(values) * 1.15))
    handles = [matplotlib.patches.Patch(color=c, label=l) for l, c in _LEVEL_COLORS.items()
               if any(_level(n) == l for n in names)]
    axes[0].legend(handles=handles, fontsize=8, loc="upper right")
    axes[0].set_title("peak memory of one optimizer step")
    axes[1].set_title("time of one optimizer step")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    """Prints the memory table and saves the bar chart.

    Args:
        argv: command-line arguments (`--help` lists them); `sys.argv` by default.

    Returns:
        A dict: `results` (one dict per configuration, see `measure`),
        `rows` (the table, in `HEADERS` order), `plot` (the PNG's path or None).

    Example:
        >>> from kmix.benchmarks import memory
        >>> out = memory.main(["--quick", "--no-plot"])
    """
    parser = argparse.ArgumentParser(
        prog="python -m kmix bench memory", description=__doc__.splitlines()[0],
        epilog="The defaults keep every weight and activation above the 256 KiB below which a CPU's "
        "allocator statistics (oneDNN's) see nothing, and take about 10 minutes on 2 CPU cores. "
        "On a GPU try --layers 8 --batch 16.")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks; default 4")
    parser.add_argument("--d-model", type=int, default=512, help="model width; default 512")
    parser.add_argument("--heads", type=int, default=8, help="attention heads; default 8")
    parser.add_argument("--seq", type=int, default=512, help="sequence length; default 512")
    parser.add_argument("--batch", type=int, default=4, help="batch size (even); default 4")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size; default 512")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps; default 3")
    parser.add_argument("--jit", action="store_true", help="compile the step with XLA")
    parser.add_argument("--plot", default=os.path.join("kmix-out", "bench_memory.png"), metavar="PATH",
                        help="where to save the PNG; default kmix-out/bench_memory.png")
    parser.add_argument("--no-plot", action="store_true", help="do not save a PNG")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 1 layer, width 64, seq 16, batch 8, vocab 4096")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.heads, args.seq, args.batch, args.vocab, args.steps = 1, 64, 2, 16, 8, 4096, 1
    if args.batch % 2 or args.batch < 2:
        parser.error(f"--batch must be even (accumulation halves it); received {args.batch}")
    if args.d_model % args.heads:
        parser.error(f"--heads must divide --d-model; received --d-model {args.d_model} --heads {args.heads}")
    size = {k: getattr(args, k) for k in ("layers", "d_model", "heads", "seq", "batch", "vocab")}
    device = device_name()
    allocator = use_a_cpu_allocator_with_statistics() if device.startswith("CPU") else None
    start = time.perf_counter()
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")
    results = []
    try:
        for i, config in enumerate(CONFIGS, 1):
            progress(f"[{i}/{len(CONFIGS)}] {config[0]}")
            results.append(measure(config, size, args.steps, args.jit))
    finally:
        logger.setLevel(level)
    title = (f"GPT-style model on {device}: {args.layers} blocks, d_model {args.d_model}, {args.heads} heads, "
             f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}, AdamW, "
             f"{'XLA' if args.jit else 'tf.function'}")
    print(title)
    rows = format_rows(results)
    print(format_table(HEADERS, rows))
    print("peak: allocator peak over one optimizer step (weights and optimizer state included); state: "
          "allocated between steps; state (report): kmix.memory_report's prediction of it.")
    if device.startswith("CPU"):
        print(f"CPU allocator: {allocator}.")
        print("On a CPU the time ratios follow its kernels (bfloat16 runs fast through oneDNN where "
              "AVX512_BF16 / AMX-BF16 exist, float16 as a tf.function does not): they say nothing "
              "about a GPU.")
    path = None
    if not args.no_plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        path = plot(results, args.plot, title)
        print(f"Plot saved to {os.path.abspath(path)}")
    progress(f"done in {time.perf_counter() - start:.0f} s")
    return {"results": results, "rows": rows, "plot": path}


if __name__ == "__main__":
    main()
