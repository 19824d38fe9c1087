"""`python -m kmix bench memory`: what each memory lever saves on a GPT-style model."""

import gc
import os
import time

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix import _compat
from kmix.benchmarks.common import (add_options, add_size_arguments, allocator_device, bench_parser, check_sizes,
                                    compiled, format_table, fresh_session, median, progress, quiet_tf_logs,
                                    ratio_bars, save_plot, time_call)
from kmix.benchmarks import gpt

CONFIGS = (  # name, policy, half, accumulation, remat, master_weights
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


def use_a_cpu_allocator_with_statistics():
    """Makes TensorFlow's CPU allocator keep the statistics `measure` reads (BFC: before the first op); which."""
    if _compat.onednn_enabled():
        return "oneDNN's (tensors under 256 KiB not seen)"
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    return "BFC (every tensor, chunks rounded up)"


def measure(config, size, steps, jit_compile):
    """Builds, trains and measures one configuration alone; returns its figures as a dict."""
    name, policy, half, accumulation, remat, master_weights = config
    fresh_session()
    device, spec = allocator_device(), kmix.Policy(policy, half=half)
    try:
        baseline = tf.config.experimental.get_memory_info(device)["current"]
    except ValueError as e:  # TensorFlow started before use_a_cpu_allocator_with_statistics
        raise RuntimeError(f"TensorFlow's allocator on {device} keeps no statistics ({e}). Run the benchmark in a new "
                           "process (`python -m kmix bench memory`), or set TF_CPU_ALLOCATOR_USE_BFC=true (or "
                           "TF_ENABLE_ONEDNN_OPTS=1) in the environment before Python starts.") from None

    def block(i, x):  # `bench train`'s GPT, each block one `Block` layer (wrapped if `remat`)
        layer = Block(size["d_model"], size["heads"], name=f"block{i}")
        return (kmix.layers.Remat(layer, name=f"remat{i}") if remat else layer)(x)

    with tf.device(device), kmix.policy_scope(spec):
        model = gpt.build_model(size["layers"], size["d_model"], size["heads"], size["seq"], size["vocab"], "kmix",
                                block=block, name="gpt_blocks")
        optimizer = keras.optimizers.AdamW(1e-4, beta_2=0.99)  # 0.999 is 1.0 in bfloat16 (the kahan row's Adam)
        if master_weights is not None:
            optimizer = kmix.wrap(optimizer, master_weights=master_weights, accumulation_steps=accumulation)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit_compile)
        tokens = np.random.default_rng(0).integers(0, size["vocab"], (size["batch"], size["seq"] + 1)).astype(np.int32)
        batches = [(tf.constant(part[:, :-1]), tf.constant(part[:, 1:])) for part in np.split(tokens, accumulation)]
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
    report = kmix.memory_report(model, spec, "adamw", master_weights=master_weights)
    row = next(iter(report.values()))  # what stays allocated between steps: params, masters, slots, accumulators
    predicted = (row["params"] + row["master_weights"] + row["optimizer_slots"]
                 + (4 * report.num_params if accumulation > 1 else 0))
    del model, optimizer
    return {"name": name, "peak_bytes": peak, "state_bytes": state, "report_state_bytes": predicted,
            "step_seconds": seconds, "loss": losses[-1]}


def format_rows(results):
    """Table rows; the ratios are against the `float32` row."""
    base = next((r for r in results if r["name"] == "float32"), None)
    return [[r["name"], _mib(r["peak_bytes"]), _mib(r["state_bytes"]), _mib(r["report_state_bytes"]),
             r["step_seconds"] * 1e3, r["peak_bytes"] / base["peak_bytes"] if base else "n/a",
             r["step_seconds"] / base["step_seconds"] if base else "n/a", r["loss"]] for r in results]


def _mib(n):
    return f"{n / 2**20:.2f} MiB"


def plot(results, path, title):
    """Saves peak memory and step time per configuration, as ratios to float32, as a PNG; returns `path`."""
    names = [r["name"] for r in results]
    return ratio_bars([(names, [r[key] / results[0][key] for r in results], label) for key, label in (
        ("peak_bytes", "peak memory of one optimizer step / float32"),
        ("step_seconds", "time of one optimizer step / float32"))], path, title)


def main(argv=None):
    """Prints the memory table and saves the bar chart; returns `{"results", "rows", "plot"}`."""
    parser = bench_parser("memory", __doc__, epilog="The defaults keep every weight and activation above the "
                          "256 KiB below which a CPU's allocator statistics (oneDNN's) see nothing, and take about "
                          "10 minutes on 2 CPU cores. On a GPU try --layers 8 --batch 16.")
    add_size_arguments(parser, layers=4, d_model=512, heads=8, seq=512, batch=4, vocab=512, steps=3)
    add_options(parser, jit="compile the step with XLA")
    parser.add_argument("--plot", default=os.path.join("kmix-out", "bench_memory.png"), metavar="PATH",
                        help="where to save the PNG; default kmix-out/bench_memory.png")
    add_options(parser, no_plot="do not save a PNG",
                quick="a smoke test: 1 layer, width 64, seq 16, batch 8, vocab 4096")
    args = parser.parse_args(argv)
    size = check_sizes(parser, args, dict(layers=1, d_model=64, heads=2, seq=16, batch=8, vocab=4096, steps=1))
    if args.batch % 2:
        parser.error(f"--batch must be even (accumulation halves it); received {args.batch}")
    device = allocator_device()
    allocator = use_a_cpu_allocator_with_statistics() if device.startswith("CPU") else None
    start, results = time.perf_counter(), []
    with quiet_tf_logs():
        for i, config in enumerate(CONFIGS, 1):
            progress(f"[{i}/{len(CONFIGS)}] {config[0]}")
            results.append(measure(config, size, args.steps, args.jit))
    title = (f"GPT-style model on {device}: {args.layers} blocks, d_model {args.d_model}, {args.heads} heads, "
             f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}, AdamW, {compiled(args.jit)}")
    rows = format_rows(results)
    print(f"{title}\n{format_table(HEADERS, rows)}")
    print("peak: allocator peak over one optimizer step (weights and optimizer state included); state: "
          "allocated between steps; state (report): kmix.memory_report's prediction of it.")
    if device.startswith("CPU"):
        print(f"CPU allocator: {allocator}.\nOn a CPU the time ratios follow its kernels (bfloat16 runs fast through "
              "oneDNN where AVX512_BF16 / AMX-BF16 exist, float16 as a tf.function does not): they say nothing about "
              "a GPU.")
    path = None if args.no_plot else save_plot(lambda p: plot(results, p, title), args.plot)
    progress(f"done in {time.perf_counter() - start:.0f} s")
    return {"results": results, "rows": rows, "plot": path}
