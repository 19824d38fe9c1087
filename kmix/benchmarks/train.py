"""`python -m kmix bench train`: a GPT-style training step under float32, float16 and bfloat16.

The model is a decoder-only transformer: token and position embeddings,
`--layers` pre-norm blocks (causal multi-head self-attention, a 4x GELU MLP)
and a language-model head, trained with AdamW on next-token prediction. Each
configuration is a policy and a stack, run as a `tf.function` graph and with XLA
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

The step time is that of the fastest of `--rounds` timed rounds. With a GPU
each configuration runs alone and its peak memory is
`tf.config.experimental.get_memory_info` of the first GPU (reset before it);
without one the configurations are built first and their rounds alternate
(`--interleave`), so that drift on a shared machine hits all alike, and
there is no memory figure (a CPU does not report one: "n/a"). On a
CPU float16 and bfloat16 math is slower than float32, so the ratios there say
nothing about a GPU; run this on one for speed figures.
"""

import argparse
import gc
import os
import time

import keras
import tensorflow as tf

import kmix
from kmix.benchmarks.common import format_table, progress, time_call
from kmix.benchmarks.gpt import build_model, compile_model, make_dataset, model_flops_per_token

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


def gpu_name():
    """`"GPU:0"` if TensorFlow sees a GPU, else None."""
    return "GPU:0" if tf.config.list_physical_devices("GPU") else None


def _reset():
    keras.backend.clear_session()
    gc.collect()
    device = gpu_name()
    if device is not None:
        tf.config.experimental.reset_memory_stats(device)


class _Run:
    """One configuration, built, compiled and traced, ready to time."""

    def __init__(self, config, size):
        policy, stack, jit_compile = config
        self.config, self.size, self.seconds, self.loss = config, size, [], None
        with kmix.policy_scope(policy):
            self.model = build_model(size["layers"], size["d_model"], size["heads"], size["seq"],
                                     size["vocab"], stack)
            compile_model(self.model, stack, jit_compile)
        self.data = make_dataset(size["batch"], size["seq"], size["vocab"])
        self.fit(2)  # traces / compiles the step and builds the optimizer

    def fit(self, steps):
        history = self.model.fit(self.data, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0)
        self.loss = float(history.history["loss"][-1])

    def time_round(self, steps):
        """Times `steps` steps; keeps the seconds per step."""
        self.seconds.append(time_call(lambda: self.fit(steps), repeats=1, warmup=0)[0] / steps)

    def result(self, peak_bytes):
        """The figures, from the fastest round (the least disturbed on a shared machine)."""
        policy, stack, jit_compile = self.config
        step = min(self.seconds)
        tokens = self.size["batch"] * self.size["seq"]
        flops = model_flops_per_token(self.model, self.size["layers"], self.size["d_model"], self.size["seq"])
        return {
            "policy": policy,
            "stack": stack,
            "jit_compile": jit_compile,
            "step_seconds": step,
            "tokens_per_second": tokens / step,
            "tflops": flops * tokens / step / 1e12,
            "peak_bytes": peak_bytes,
            "loss": self.loss,
        }


def measure(config, size, steps, rounds):
    """Trains one configuration alone and returns its figures (see `measure_all`)."""
    _reset()
    run = _Run(config, size)
    for _ in range(rounds):
        run.time_round(steps)
    device = gpu_name()
    return run.result(tf.config.experimental.get_memory_info(device)["peak"] if device else None)


def measure_all(configs, size, steps, rounds, interleave):
    """Measures every configuration; returns one dict of figures per configuration.

    Args:
        configs: `(policy, stack, jit_compile)` triples.
        size: dict with `layers`, `d_model`, `heads`, `seq`, `batch`, `vocab`.
        steps: steps per timed round.
        rounds: timed rounds; the step time is that of the fastest round.
        interleave: build every configuration first, then time round 1 of
            each, round 2 of each, ...: drift on a shared machine then hits
            all of them alike. Otherwise each runs alone, after the previous
            one is freed, so that its peak device memory is its own.

    Returns:
        Dicts with `policy`, `stack`, `jit_compile`, `step_seconds`,
        `tokens_per_second`, `tflops`, `peak_bytes` (None where the device
        does not report it, and when interleaved), `loss` (the last
        training loss, to show the step really trained).
    """
    label = lambda c: f"{c[0]}, {c[1]}, {'XLA' if c[2] else 'tf.function'}"  # noqa: E731
    if not interleave:
        results = []
        for i, config in enumerate(configs, 1):
            progress(f"[{i}/{len(configs)}] {label(config)}")
            results.append(measure(config, size, steps, rounds))
        return results
    _reset()
    runs = []
    for i, config in enumerate(configs, 1):
        progress(f"[{i}/{len(configs)}] building and compiling {label(config)}")
        runs.append(_Run(config, size))
    for r in range(rounds):
        progress(f"timing round {r + 1}/{rounds}")
        for run in runs:
            run.time_round(steps)
    return [run.result(None) for run in runs]


def fits(policy, stack, size, batch):
    """Whether two XLA-compiled training steps at `batch` run without running out of memory."""
    _reset()
    try:
        with kmix.policy_scope(policy):
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
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, the fastest is shown; default 5")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated policies; default " + ",".join(POLICIES))
    parser.add_argument("--jit", choices=["both", "on", "off"], default="both",
                        help="tf.function (off), XLA (on) or both; default both")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                        help="enable (--tf32) or disable (--no-tf32) TF32 float32 matmuls on "
                        "compute capability 8.0+; default: TensorFlow's setting (enabled)")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="build every configuration first and alternate their timed rounds, so that "
                        "drift on a shared machine hits all alike; no peak memory then. Default: on "
                        "without a GPU, off with one (each configuration alone, with its own peak memory)")
    parser.add_argument("--max-batch", action="store_true",
                        help="also find the largest batch that trains, per policy (XLA; kmix stack, Keras for float32): "
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
    interleave = args.interleave if args.interleave is not None else device is None
    start = time.perf_counter()
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")  # every configuration traces its own step: TF's retracing warning is noise here
    try:
        results = measure_all(configs, size, args.steps, args.rounds, interleave)
    finally:
        logger.setLevel(level)
    print(f"GPT-style training step on {where}: {args.layers} layers, d_model {args.d_model}, "
          f"{args.heads} heads, seq {args.seq}, batch {args.batch}, vocab {args.vocab}; "
          f"TF32 {'on' if tf32 else 'off'}; fastest of {args.rounds} "
          f"{'interleaved ' if interleave else ''}rounds of {args.steps} steps")
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
