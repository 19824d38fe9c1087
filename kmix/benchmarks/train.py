"""`python -m kmix bench train`: one model's training step on every route a user could take, in one run.

The routes (see `kmix.benchmarks.routes`), in table order:

- `float32`, `keras`: plain Keras with Keras's default compile
  (`jit_compile="auto"`: XLA only with a GPU): the baseline of the ratios;
- `mixed_bfloat16` and `mixed_float16`, `keras`: plain Keras mixed
  precision (Keras's own `LossScaleOptimizer` under float16);
- `float32`, `tf-rewrite`: the float32 model under TensorFlow's own
  grappler mixed-precision rewrite (oneDNN bfloat16 on a CPU, float16 on a
  GPU), the anchor a user could pick instead of any library;
- `float32`, `mixed_bfloat16` and `mixed_float16`, `kmix`: kmix's layers and
  `kmix.wrap` under the same global policies (against the keras rows: what
  kmix's safety costs, and what its fused Adam update gains, which the
  float32 row shows alone);
- the policy `kmix.recommend()` picks, `recommended`: `kmix.autocast` +
  `kmix.wrap` + the recommended `jit_compile`, the route the README gives;
- the route `kmix.recommend(model, sample=...)` picks from timing this
  model's own training step, `recommend(model)`, built the same way. Its
  table of routes is printed, with its ratio to Keras's default float32
  compile and to the fastest row.

`--jit both` adds every policy row under XLA as well. The model is the
GPT-style decoder of `kmix.benchmarks.gpt` (`--model gpt`, the default: at
d_model 512 its matmuls dominate the step) or
`keras.applications.ResNet50(weights=None)` at a small input (`--model resnet50`).

Model FLOP/s (GPT only) follow PaLM's model-FLOPs convention (Chowdhery et
al. 2022, appendix B): per token `6 * N + 12 * layers * d_model * seq`,
where N counts the parameters that take part in matmuls (all but the two
embedding tables) and the second term is the attention products, forward
and backward, counted in full.

The step time is the median of `--rounds` timed rounds. With a GPU
each route runs alone and its peak memory is
`tf.config.experimental.get_memory_info` of the first GPU; without one the
routes are built first and their rounds alternate (`--interleave`), so that
drift on a shared machine hits all alike (no memory figure then:
`bench memory` measures the CPU's).
"""

import argparse
import gc
import os
import time

import keras
import tensorflow as tf

import kmix
from kmix.route import timing
from kmix.benchmarks.common import format_table, progress, time_call
from kmix.benchmarks.gpt import build_model, compile_model, make_dataset, model_flops_per_token
from kmix.benchmarks.routes import MODELS, Route, recommend_on_model, rewrite_option as rewrite_key

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
HEADERS = ["policy", "stack", "compiled", "ms/step", "items/s", "TFLOP/s", "peak mem",
           "speed x f32", "mem x f32"]
AUTO = "auto"  # Keras's default jit_compile


def configurations(policies, jit_modes, recommendation=None, model_recommendation=None):
    """The `(policy, stack, jit_compile)` triples one run measures, in table order.

    Args:
        policies: the policies of the keras and kmix rows (`POLICIES` by default).
        jit_modes: a list of `"auto"`, False and/or True.
        recommendation: a `kmix.Recommendation` for the `recommended` row, or None.
        model_recommendation: `kmix.recommend(model, ...)`'s, for the last row, or None.
    """
    configs = []
    for jit in jit_modes:
        configs += [(p, "keras", jit) for p in policies]
    if "float32" in policies:
        configs.append(("float32", "tf-rewrite", False))
    for jit in jit_modes:
        configs += [(p, "kmix", jit) for p in policies]
    if recommendation is not None:
        configs.append((recommendation.policy, "recommended", recommendation.jit_compile))
    if model_recommendation is not None:
        configs.append((model_recommendation.policy, "recommend(model)", model_recommendation.jit_compile))
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
    """One route, built, compiled and traced, ready to time."""

    def __init__(self, config, model_name, size):
        policy, stack, jit_compile = config
        self.config, self.model_name, self.size, self.seconds = config, model_name, size, []
        self.route = Route(model_name, size, policy, stack, jit_compile)
        self.route.train(2)  # traces / compiles the step and builds the optimizer

    def time_round(self, steps):
        """One untimed step, then times `steps` steps; keeps the seconds per step.

        The untimed step absorbs a first call that traces or instantiates
        anything again.
        """
        self.route.train(1)
        self.seconds.append(time_call(lambda: self.route.train(steps), repeats=1, warmup=0)[0] / steps)

    def result(self, peak_bytes, phase=None):
        """The figures: the median round, and the rounds (`phase`: which interleaved rounds they were in)."""
        step = timing.median(self.seconds)
        items = self.route.items
        tflops = None
        if self.model_name == "gpt":
            flops = model_flops_per_token(self.route.model, self.size["layers"], self.size["d_model"],
                                          self.size["seq"])
            tflops = flops * items / step / 1e12
        return {
            "policy": self.route.policy,
            "stack": self.route.stack,
            "jit_compile": self.route.jit_compile,
            "step_seconds": step,
            "tokens_per_second": items / step,
            "tflops": tflops,
            "peak_bytes": peak_bytes,
            "loss": self.route.loss,
            "rounds": tuple(self.seconds),
            "phase": phase,
        }


def measure(config, size, steps, rounds, model_name="gpt"):
    """Trains one route alone and returns its figures (see `measure_all`)."""
    _reset()
    run = _Run(config, model_name, size)
    for _ in range(rounds):
        run.time_round(steps)
    device = gpu_name()
    return run.result(tf.config.experimental.get_memory_info(device)["peak"] if device else None)


def measure_all(configs, size, steps, rounds, interleave, model_name="gpt"):
    """Measures every route; returns one dict of figures per route.

    Args:
        configs: `(policy, stack, jit_compile)` triples.
        size: see `kmix.benchmarks.routes.build`.
        steps: steps per timed round.
        rounds: timed rounds; the step time is the median round.
        interleave: build every route first, then time round 1 of each,
            round 2 of each, ...: drift on a shared machine then hits all of
            them alike. Otherwise each runs alone, after the previous one is
            freed, so that its peak device memory is its own. Either way
            the `tf-rewrite` route runs after the others (alone), since
            switching TensorFlow's rewrite on and off slows the functions of
            routes that run after it. Interleaved rounds rotate the order
            of the routes from one round to the next.
        model_name: `"gpt"` or `"resnet50"`.

    Returns:
        Dicts with `policy`, `stack`, `jit_compile` (as resolved: Keras's
        `"auto"` becomes a bool), `step_seconds`, `tokens_per_second` (items:
        tokens for the GPT, images for ResNet), `tflops` (None for ResNet),
        `peak_bytes` (None where the device does not report it, and when
        interleaved), `loss` (the last training loss, to show it trained),
        `rounds` (seconds per step of each round) and `phase` (routes of
        the same phase ran in the same interleaved rounds, so their ratios
        are taken round by round; None when each ran alone).
    """
    label = lambda c: f"{c[0]}, {c[1]}, {'XLA' if c[2] is True else 'tf.function' if c[2] is False else 'default compile'}"  # noqa: E731
    # TensorFlow's rewrite runs last: once its option has been set and unset, the functions of
    # the other routes ran slower for the rest of the process on our CPUs (2026-11-23).
    order = sorted(range(len(configs)), key=lambda i: configs[i][1] == "tf-rewrite")
    results = [None] * len(configs)
    if not interleave:
        for n, i in enumerate(order, 1):
            progress(f"[{n}/{len(configs)}] {label(configs[i])}")
            results[i] = measure(configs[i], size, steps, rounds, model_name)
        return results
    _reset()
    phases = [[i for i in order if configs[i][1] != "tf-rewrite"], [i for i in order if configs[i][1] == "tf-rewrite"]]
    done = 0
    for phase in phases:
        runs = {}
        for i in phase:
            done += 1
            progress(f"[{done}/{len(configs)}] building and compiling {label(configs[i])}")
            runs[i] = _Run(configs[i], model_name, size)
        live = list(runs.values())
        for r in range(rounds if runs else 0):
            progress(f"timing round {r + 1}/{rounds}" + (" (the rewrite, alone)" if phase is phases[1] else ""))
            for run in live[r % len(live):] + live[:r % len(live)]:
                run.time_round(steps)
        for i, run in runs.items():
            results[i] = run.result(None, phases.index(phase))
    return results


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
    """Table rows, with each row's ratios against the baseline: float32 Keras, default compile.

    The baseline is the first `float32` / `keras` row (the default compile
    comes first); ratios are its step time (or peak memory) over this row's.
    """
    base = next((r for r in results if r["policy"] == "float32" and r["stack"] == "keras"), None)
    rows = []
    for r in results:
        speed = speedup(base, r) if base else "n/a"
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
            "n/a" if r["tflops"] is None else r["tflops"],
            _bytes(r["peak_bytes"]),
            speed,
            mem_ratio,
        ])
    return rows


def speedup(base, row):
    """`base`'s step time over `row`'s: round by round (the median ratio) where they ran in the same
    interleaved rounds, else the ratio of their median rounds."""
    if base.get("phase") is not None and base.get("phase") == row.get("phase"):
        return timing.paired(base["rounds"], row["rounds"])[0]
    return base["step_seconds"] / row["step_seconds"]


def summary_line(results):
    """The `recommend(model)` row against Keras's default float32 compile and the fastest row."""
    row = next((r for r in results if r["stack"] == "recommend(model)"), None)
    base = next((r for r in results if r["policy"] == "float32" and r["stack"] == "keras"), None)
    if row is None:
        return ""
    fastest = min(results, key=lambda r: r["step_seconds"])
    label = lambda r: f"{r['policy']}, {r['stack']}, {'XLA' if r['jit_compile'] else 'tf.function'}"  # noqa: E731
    against_base = f"{speedup(base, row):.2f}x Keras's default float32 compile, " if base else ""
    return (f"kmix.recommend(model) chose {row['policy']}, {'XLA' if row['jit_compile'] else 'tf.function'}: "
            f"{against_base}{speedup(fastest, row):.2f}x the fastest row "
            f"({label(fastest)}) in this table.")


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
    axes[0, 0].set(title="training throughput", ylabel="items / s (tokens or images)")
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
        A dict: `results` (one dict per route, see `measure_all`), `rows`
        (the table's rows, in `HEADERS` order), `recommendation` (the
        `kmix.Recommendation` of the `recommended` row, or None with `--no-recommended`),
        `model_recommendation` (`kmix.recommend(model, ...)`'s, with its `table`, or None
        with `--no-recommend-model`), `max_batch` (`{policy: (batch, capped)}`, empty unless measured),
        `plot` (the PNG's path or None).

    Example:
        >>> from kmix.benchmarks import train
        >>> out = train.main(["--quick"])
    """
    parser = argparse.ArgumentParser(prog="python -m kmix bench train", description=__doc__.splitlines()[0],
                                     epilog="Defaults: matmuls dominate the step, and a 2-core CPU finishes in "
                                     "about 3 minutes. A GPU-sized run: --layers 12 --d-model 768 --heads 12 "
                                     "--seq 1024 --batch 16 --vocab 50304 --steps 20")
    parser.add_argument("--model", choices=MODELS, default="gpt", help="the model; default gpt")
    parser.add_argument("--layers", type=int, default=2, help="GPT: transformer blocks; default 2")
    parser.add_argument("--d-model", type=int, default=512, help="GPT: model width; default 512")
    parser.add_argument("--heads", type=int, default=8, help="GPT: attention heads (must divide --d-model); default 8")
    parser.add_argument("--seq", type=int, default=128, help="GPT: sequence length; default 128")
    parser.add_argument("--vocab", type=int, default=2048, help="GPT: vocabulary size; default 2048")
    parser.add_argument("--image", type=int, default=64, help="ResNet50: image side in pixels (>= 32); default 64")
    parser.add_argument("--batch", type=int, default=8, help="batch size; default 8")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round; default 5")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds, the median is shown; default 6")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated policies of the keras and kmix rows; default " + ",".join(POLICIES))
    parser.add_argument("--jit", choices=["auto", "both", "on", "off"], default="auto",
                        help="the keras and kmix rows: Keras's default compile (auto: XLA only with a GPU), "
                        "tf.function (off), XLA (on) or both; default auto")
    parser.add_argument("--recommended", action=argparse.BooleanOptionalAction, default=True,
                        help="add the route kmix.recommend() picks on this device (default on)")
    parser.add_argument("--recommend-model", action=argparse.BooleanOptionalAction, default=True,
                        help="add the route kmix.recommend(model, sample=...) picks from timing this model's "
                        "own step, and print its table (default on)")
    parser.add_argument("--recommend-budget", type=float, default=30.0,
                        help="budget_s of kmix.recommend(model, ...); default 30 (--quick: 3)")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                        help="enable (--tf32) or disable (--no-tf32) TF32 float32 matmuls on "
                        "compute capability 8.0+; default: TensorFlow's setting (enabled)")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="build every route first and alternate their timed rounds, so that "
                        "drift on a shared machine hits all alike; no peak memory then. Default: on "
                        "without a GPU, off with one (each route alone, with its own peak memory)")
    parser.add_argument("--max-batch", action="store_true",
                        help="GPT: also find the largest batch that trains, per policy (XLA; kmix stack, Keras "
                        "for float32): doubling from --batch, then bisecting; GPU only unless --force")
    parser.add_argument("--max-batch-limit", type=int, default=2**16,
                        help="stop doubling at this batch; default 65536")
    parser.add_argument("--force", action="store_true", help="run --max-batch on a CPU anyway")
    parser.add_argument("--plot", nargs="?", const=os.path.join("kmix-out", "bench_train.png"), default=None,
                        metavar="PATH", help="save a PNG of the results (default path kmix-out/bench_train.png)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: GPT 1 layer, width 16, seq 16 (ResNet50 32x32), batch 2, "
                        "2 steps, 1 round, a tiny probe")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        parser.error(f"--policies accepts {', '.join(POLICIES)}; received {args.policies!r}")
    if args.quick:
        args.layers, args.d_model, args.heads, args.seq, args.batch = 1, 16, 2, 16, 2
        args.vocab, args.steps, args.rounds, args.image = 64, 2, 1, 32
        args.recommend_budget = min(args.recommend_budget, 3.0)
    if args.d_model % args.heads:
        parser.error(f"--heads must divide --d-model; received --d-model {args.d_model} --heads {args.heads}")
    for name in ("layers", "d_model", "heads", "seq", "batch", "vocab", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; received {getattr(args, name)}")
    if args.image < 32:
        parser.error(f"--image must be >= 32 (ResNet50's smallest input); received {args.image}")

    if args.tf32 is not None:
        tf.config.experimental.enable_tensor_float_32_execution(args.tf32)
    size = {k: getattr(args, k) for k in ("layers", "d_model", "heads", "seq", "batch", "vocab", "image")}
    size["classes"] = 10
    jit_modes = {"auto": [AUTO], "both": [False, True], "on": [True], "off": [False]}[args.jit]
    start = time.perf_counter()
    recommendation = None
    if args.recommended:
        progress("kmix.recommend(): probing this device")
        recommendation = kmix.recommend(probe=kmix.device.probe((64, 16, 32), budget=0.02) if args.quick else None)
    model_recommendation = None
    if args.recommend_model:
        progress(f"kmix.recommend(model, ...): timing this model's own step on each route "
                 f"(budget_s={args.recommend_budget:g})")
        model_recommendation = recommend_on_model(args.model, size, args.recommend_budget,
                                                  recommendation.probe if recommendation else None)
    configs = configurations(policies, jit_modes, recommendation, model_recommendation)
    device = gpu_name()
    where = tf.config.experimental.get_device_details(
        tf.config.list_physical_devices("GPU")[0]).get("device_name", "GPU") if device else \
        f"CPU ({kmix.device.cpu_features()['model']})"
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    interleave = args.interleave if args.interleave is not None else device is None
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")  # every route traces its own step: TF's retracing warning is noise here
    try:
        results = measure_all(configs, size, args.steps, args.rounds, interleave, args.model)
    finally:
        logger.setLevel(level)
    if args.model == "gpt":
        what = (f"GPT-style training step: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
                f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}")
    else:
        what = f"ResNet50 training step: {args.image}x{args.image} images, batch {args.batch}, 10 classes"
    print(f"{what}; on {where}; TF32 {'on' if tf32 else 'off'}; median of {args.rounds} "
          f"{'interleaved ' if interleave else ''}rounds of {args.steps} steps")
    rows = format_rows(results)
    print(format_table(HEADERS, rows))
    print("items/s: tokens (GPT) or images (ResNet). TFLOP/s: model FLOPs, 6 * params (without embeddings) "
          "+ 12 * layers * d_model * seq per token. speed x f32: the float32 Keras row's step time "
          "(Keras's default compile) / this one's" + (", round by round (the median ratio; the rewrite's "
          "rounds ran alone: the ratio of medians)." if interleave else "."))
    if recommendation is not None:
        print(recommendation)
    if model_recommendation is not None:
        print("kmix.recommend(model, ...) on this model:")
        print(model_recommendation)
        print(summary_line(results))
    for row in results:
        if row["stack"] == "tf-rewrite":
            print(f"tf-rewrite: tf.config.optimizer.set_experimental_options({{{rewrite_key()!r}: True}}) "
                  "on the float32 model.")

    max_batch = {}
    if args.max_batch and args.model != "gpt":
        print("--max-batch: measured for the GPT model only; skipped.")
    elif args.max_batch and not device and not args.force:
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
    return {"results": results, "rows": rows, "recommendation": recommendation,
            "model_recommendation": model_recommendation, "max_batch": max_batch, "plot": path}


if __name__ == "__main__":
    main()
