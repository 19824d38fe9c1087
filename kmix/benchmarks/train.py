"""`python -m kmix bench train`: a GPT-style training step under float32, float16 and bfloat16.

The model is a decoder-only transformer: token and position embeddings,
`--layers` pre-norm blocks (causal multi-head self-attention, a 4x GELU MLP)
and a language-model head, trained with AdamW on next-token prediction. Each
configuration is a policy and a stack, eager-graph (`tf.function`) and XLA
(`jit_compile=True`):

- `float32`, stack `keras`: plain Keras, the baseline of the ratios;
- `mixed_float16`, stack `keras`: plain Keras mixed precision, i.e.
  `keras.layers.MultiHeadAttention` and the `LossScaleOptimizer` that
  `compile` wraps around the optimizer by itself;
- `mixed_float16` and `mixed_bfloat16`, stack `kmix`:
  `kmix.layers.MultiHeadAttention` (float32 softmax) and `kmix.wrap`.

The keras and kmix rows at `mixed_float16` show what kmix's safety costs.

Model FLOP/s follow PaLM's model-FLOPs convention (Chowdhery et al. 2022,
appendix B): per token `6 * N + 12 * layers * d_model * seq`, where N counts
the parameters that take part in matmuls (all but the two embedding tables)
and the second term is the attention score and value products, forward and
backward, counted in full (not halved for the causal mask). Rematerialisation
and other non-model work are not counted, so this is the "model" rate.

Peak memory is `tf.config.experimental.get_memory_info` of the first GPU
(reset before each configuration); a CPU does not report it ("n/a"). On a
CPU float16 and bfloat16 math is slower than float32, so the ratios there say
nothing about a GPU; run this on one for speed figures.
"""

import argparse
import gc
import os
import time

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix.benchmarks.common import format_table, median, progress, time_call

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
HEADERS = ["policy", "stack", "compiled", "ms/step", "tokens/s", "TFLOP/s", "peak mem",
           "speed x f32", "mem x f32"]


def configurations(policies, jit_modes):
    """The `(policy, stack, jit_compile)` triples one run measures, in table order."""
    configs = []
    for jit in jit_modes:
        for policy in policies:
            if policy == "float32":
                configs.append((policy, "keras", jit))
            elif policy == "mixed_float16":
                configs += [(policy, "keras", jit), (policy, "kmix", jit)]
            else:
                configs.append((policy, "kmix", jit))
    return configs


class PositionEmbedding(keras.layers.Layer):
    """Adds a trained embedding of each position to `(batch, seq, d_model)` inputs."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer="random_normal", name="embeddings")

    def call(self, x):
        return x + self.table[None]


def build_model(layers, d_model, heads, seq, vocab, stack):
    """The GPT-style model under the current dtype policy (uncompiled).

    Args:
        layers, d_model, heads, seq, vocab: the model's size.
        stack: `"keras"` for `keras.layers.MultiHeadAttention`, `"kmix"` for
            `kmix.layers.MultiHeadAttention`.

    Returns:
        A functional `keras.Model` from `(batch, seq)` int32 tokens to
        float32 logits `(batch, seq, vocab)`.
    """
    attention = kmix.layers.MultiHeadAttention if stack == "kmix" else keras.layers.MultiHeadAttention
    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, d_model, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    for i in range(layers):
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln_attn{i}")(x)
        h = attention(heads, d_model // heads, name=f"attention{i}")(h, h, use_causal_mask=True)
        x = x + h
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"ln_mlp{i}")(x)
        h = keras.layers.Dense(4 * d_model, activation="gelu", name=f"mlp_in{i}")(h)
        x = x + keras.layers.Dense(d_model, name=f"mlp_out{i}")(h)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln_final")(x)
    logits = keras.layers.Dense(vocab, name="lm_head")(x)
    # The loss is computed in float32, the head's matmul in the compute dtype.
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(logits)
    return keras.Model(tokens, logits, name=f"gpt_{stack}")


def model_flops_per_token(model, layers, d_model, seq):
    """PaLM's model FLOPs per trained token: `6 * N + 12 * layers * d_model * seq`.

    `N` is the trainable parameter count without the embedding tables.
    """
    embeddings = sum(
        int(np.prod(w.shape)) for layer in model.layers if "embedding" in layer.name for w in layer.trainable_weights
    )
    n = sum(int(np.prod(w.shape)) for w in model.trainable_weights) - embeddings
    return 6 * n + 12 * layers * d_model * seq


def compile_model(model, stack, jit_compile):
    """Compiles with AdamW; `kmix.wrap` for the kmix stack, Keras's own wrapping otherwise."""
    optimizer = keras.optimizers.AdamW(1e-4)
    if stack == "kmix":
        optimizer = kmix.wrap(optimizer)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def make_dataset(batch, seq, vocab):
    """One random batch of tokens and next tokens, repeated forever, as a `tf.data.Dataset`."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(batch, seq + 1)).astype(np.int32)
    return tf.data.Dataset.from_tensors((tokens[:, :-1], tokens[:, 1:])).repeat()


def gpu_name():
    """`"GPU:0"` if TensorFlow sees a GPU, else None."""
    return "GPU:0" if tf.config.list_physical_devices("GPU") else None


def _reset():
    keras.backend.clear_session()
    gc.collect()
    device = gpu_name()
    if device is not None:
        tf.config.experimental.reset_memory_stats(device)


def measure(config, size, steps, rounds):
    """Trains one configuration; returns a dict of its figures.

    Args:
        config: `(policy, stack, jit_compile)`.
        size: dict with `layers`, `d_model`, `heads`, `seq`, `batch`, `vocab`.
        steps: steps per timed round.
        rounds: timed rounds; the step time is the median over rounds.

    Returns:
        A dict: `policy`, `stack`, `jit_compile`, `step_seconds`,
        `tokens_per_second`, `tflops`, `peak_bytes` (None off GPU), `loss`
        (the last training loss, to show the step really trained).
    """
    policy, stack, jit_compile = config
    _reset()
    keras.config.set_dtype_policy(policy)
    try:
        model = build_model(size["layers"], size["d_model"], size["heads"], size["seq"], size["vocab"], stack)
        compile_model(model, stack, jit_compile)
        data = make_dataset(size["batch"], size["seq"], size["vocab"])
        logs = {}

        def fit(n):
            history = model.fit(data, steps_per_epoch=n, epochs=1, shuffle=False, verbose=0)
            logs["loss"] = history.history["loss"][-1]

        fit(2)  # trace / compile, build the optimizer
        seconds = [t / steps for t in time_call(lambda: fit(steps), repeats=rounds, warmup=0)]
        device = gpu_name()
        peak = tf.config.experimental.get_memory_info(device)["peak"] if device else None
        step = median(seconds)
        tokens = size["batch"] * size["seq"]
        flops = model_flops_per_token(model, size["layers"], size["d_model"], size["seq"]) * tokens
        return {
            "policy": policy,
            "stack": stack,
            "jit_compile": jit_compile,
            "step_seconds": step,
            "tokens_per_second": tokens / step,
            "tflops": flops / step / 1e12,
            "peak_bytes": peak,
            "loss": float(logs["loss"]),
        }
    finally:
        keras.config.set_dtype_policy("float32")


def fits(policy, stack, size, batch):
    """Whether two XLA-compiled training steps at `batch` run without running out of memory."""
    _reset()
    keras.config.set_dtype_policy(policy)
    try:
        model = build_model(size["layers"], size["d_model"], size["heads"], size["seq"], size["vocab"], stack)
        compile_model(model, stack, jit_compile=True)
        data = make_dataset(batch, size["seq"], size["vocab"])
        model.fit(data, steps_per_epoch=2, epochs=1, shuffle=False, verbose=0)
        return True
    except tf.errors.ResourceExhaustedError:
        return False
    except tf.errors.InternalError as e:  # XLA reports some allocation failures this way
        if "out of memory" in str(e).lower() or "resource_exhausted" in str(e).lower():
            return False
        raise
    finally:
        keras.config.set_dtype_policy("float32")
        _reset()


def largest_batch(policy, stack, size, start, limit):
    """The largest batch that trains, doubling from `start`, then bisecting.

    Bisection stops when the gap is within 1/16 of the batch (or 1), so the
    answer is within about 6% below the true limit.

    Returns:
        `(batch, capped)`: the largest batch found and whether `limit` was
        reached before anything failed (then the real limit is higher).
    """
    if not fits(policy, stack, size, start):
        lo, hi = 0, start
    else:
        lo, hi = start, None
        while hi is None:
            nxt = min(lo * 2, limit)
            progress(f"  {policy}: batch {lo} fits; trying {nxt}")
            if nxt == lo:
                return lo, True
            if fits(policy, stack, size, nxt):
                lo = nxt
            else:
                hi = nxt
    while hi - lo > max(1, lo // 16):
        mid = (lo + hi) // 2
        progress(f"  {policy}: between {lo} and {hi}; trying {mid}")
        if fits(policy, stack, size, mid):
            lo = mid
        else:
            hi = mid
    return lo, False


def format_rows(results):
    """Table rows, with each row's ratios against float32 at the same compilation."""
    baseline = {r["jit_compile"]: r for r in results if r["policy"] == "float32"}
    rows = []
    for r in results:
        base = baseline.get(r["jit_compile"])
        speed = base["step_seconds"] / r["step_seconds"] if base else "n/a"
        if base and r["peak_bytes"] is not None and base["peak_bytes"]:
            mem_ratio = r["peak_bytes"] / base["peak_bytes"]
        else:
            mem_ratio = "n/a"
        rows.append([
            r["policy"],
            r["stack"],
            "XLA" if r["jit_compile"] else "tf.function",
            r["step_seconds"] * 1e3,
            round(r["tokens_per_second"]),
            r["tflops"],
            _bytes(r["peak_bytes"]),
            speed,
            mem_ratio,
        ])
    return rows


def _bytes(n):
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def plot(results, path):
    """Saves tokens/s (and peak memory where known) per configuration as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['policy']}\n{r['stack']}, {'XLA' if r['jit_compile'] else 'tf.fn'}" for r in results]
    has_memory = all(r["peak_bytes"] is not None for r in results)
    fig, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(13 if has_memory else 8, 4.5), squeeze=False)
    colors = {"float32": "tab:blue", "mixed_float16": "tab:orange", "mixed_bfloat16": "tab:green"}
    color = [colors.get(r["policy"], "tab:gray") for r in results]
    axes[0, 0].bar(range(len(results)), [r["tokens_per_second"] for r in results], color=color)
    axes[0, 0].set(title="training throughput", ylabel="tokens / s")
    if has_memory:
        axes[0, 1].bar(range(len(results)), [r["peak_bytes"] / 2**30 for r in results], color=color)
        axes[0, 1].set(title="peak device memory", ylabel="GiB")
    for ax in axes[0]:
        ax.set_xticks(range(len(results)), labels, fontsize=7, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    """Prints the training-step table (and the largest batches with `--max-batch`).

    Args:
        argv: command-line arguments (`--help` lists them); `sys.argv` by default.

    Returns:
        A dict: `results` (one dict per configuration, see `measure`),
        `rows` (the table's rows, in `HEADERS` order), `max_batch`
        (`{policy: (batch, capped)}`, empty unless measured), `plot` (the
        PNG's path or None).

    Example:
        >>> from kmix.benchmarks import train
        >>> out = train.main(["--quick"])
    """
    parser = argparse.ArgumentParser(prog="python -m kmix bench train", description=__doc__.splitlines()[0],
                                     epilog="Defaults are tiny so that a CPU finishes in a minute or two; "
                                     "a GPU-sized run: --layers 12 --d-model 768 --heads 12 --seq 1024 "
                                     "--batch 16 --vocab 50304 --steps 20")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks; default 2")
    parser.add_argument("--d-model", type=int, default=64, help="model width; default 64")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (must divide --d-model); default 4")
    parser.add_argument("--seq", type=int, default=64, help="sequence length; default 64")
    parser.add_argument("--batch", type=int, default=8, help="batch size; default 8")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size; default 512")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round; default 10")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, the median is shown; default 3")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated policies; default " + ",".join(POLICIES))
    parser.add_argument("--jit", choices=["both", "on", "off"], default="both",
                        help="tf.function (off), XLA (on) or both; default both")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                        help="enable (--tf32) or disable (--no-tf32) TF32 float32 matmuls on "
                        "compute capability 8.0+; default: TensorFlow's setting (enabled)")
    parser.add_argument("--max-batch", action="store_true",
                        help="also find the largest batch that trains, per policy (kmix stack, XLA): "
                        "doubling from --batch, then bisecting; GPU only unless --force")
    parser.add_argument("--max-batch-limit", type=int, default=2**16,
                        help="stop doubling at this batch; default 65536")
    parser.add_argument("--force", action="store_true", help="run --max-batch on a CPU anyway")
    parser.add_argument("--plot", nargs="?", const=os.path.join("kmix-out", "bench_train.png"), default=None,
                        metavar="PATH", help="save a PNG of the results (default path kmix-out/bench_train.png)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 1 layer, width 16, seq 16, batch 2, 2 steps, 1 round")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        parser.error(f"--policies accepts {', '.join(POLICIES)}; received {args.policies!r}")
    if args.quick:
        args.layers, args.d_model, args.heads, args.seq, args.batch = 1, 16, 2, 16, 2
        args.vocab, args.steps, args.rounds = 64, 2, 1
    if args.d_model % args.heads:
        parser.error(f"--heads must divide --d-model; received --d-model {args.d_model} --heads {args.heads}")
    for name in ("layers", "d_model", "heads", "seq", "batch", "vocab", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; received {getattr(args, name)}")

    if args.tf32 is not None:
        tf.config.experimental.enable_tensor_float_32_execution(args.tf32)
    size = {k: getattr(args, k) for k in ("layers", "d_model", "heads", "seq", "batch", "vocab")}
    jit_modes = {"both": [False, True], "on": [True], "off": [False]}[args.jit]
    configs = configurations(policies, jit_modes)
    device = gpu_name()
    where = tf.config.experimental.get_device_details(
        tf.config.list_physical_devices("GPU")[0]).get("device_name", "GPU") if device else "CPU"
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    results = []
    start = time.perf_counter()
    for i, config in enumerate(configs, 1):
        policy, stack, jit = config
        progress(f"[{i}/{len(configs)}] {policy}, {stack}, {'XLA' if jit else 'tf.function'}")
        results.append(measure(config, size, args.steps, args.rounds))
    print(f"GPT-style training step on {where}: {args.layers} layers, d_model {args.d_model}, "
          f"{args.heads} heads, seq {args.seq}, batch {args.batch}, vocab {args.vocab}; "
          f"TF32 {'on' if tf32 else 'off'}; median of {args.rounds} x {args.steps} steps")
    rows = format_rows(results)
    print(format_table(HEADERS, rows))
    print("TFLOP/s: model FLOPs, 6 * params (without embeddings) + 12 * layers * d_model * seq per token; "
          "speed x f32: float32 step time / this one's, at the same compilation.")
    if not device:
        print("On a CPU half precision is slower than float32: these ratios say nothing about a GPU.")

    max_batch = {}
    if args.max_batch and not device and not args.force:
        print("--max-batch: not meaningful on a CPU (host memory swaps instead of failing); skipped. "
              "Pass --force to run it anyway.")
    elif args.max_batch:
        for policy in policies:
            stack = "keras" if policy == "float32" else "kmix"
            progress(f"largest batch, {policy} ({stack}, XLA)")
            max_batch[policy] = largest_batch(policy, stack, size, args.batch, args.max_batch_limit)
        base = max_batch.get("float32", (None,))[0]
        table = [[p, f"{b}{'+' if capped else ''}", b / base if base else "n/a"]
                 for p, (b, capped) in max_batch.items()]
        print(format_table(["policy", "largest batch", "x f32"], table))
        if any(capped for _, capped in max_batch.values()):
            print(f"+: still fits at --max-batch-limit {args.max_batch_limit}.")

    path = None
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        path = plot(results, args.plot)
        print(f"Plot saved to {os.path.abspath(path)}")
    progress(f"done in {time.perf_counter() - start:.0f} s")
    return {"results": results, "rows": rows, "max_batch": max_batch, "plot": path}


if __name__ == "__main__":
    main()
