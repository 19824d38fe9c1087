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
- `O1-bfloat16` and `O1-float16`, `autocast`: the float32 model placed by
  `kmix.autocast` (the README's route), against Keras's own mixed policy
  on the same model;
- the policy `kmix.recommend()` picks, `recommended`: `kmix.autocast` +
  `kmix.wrap` + the recommended `jit_compile`, the route the README gives;
- the route `kmix.recommend(model, sample=...)` picks from timing this
  model's own training step, `recommend(model)`, built the same way. Its
  table of routes is printed, with its ratio to Keras's default float32
  compile and to the fastest row.

`--jit both` adds every policy row under XLA as well. The model is the
GPT-style decoder of `kmix.benchmarks.gpt` (`--model gpt`, the default: at
d_model 512 its matmuls dominate the step),
`keras.applications.ResNet50` / `MobileNetV2(weights=None)` at a small input
(`--model resnet50`, `mobilenetv2`), a keras-hub GPT-2 backbone with an
untied `Dense` LM head (`--model gpt2-lm`, vocabulary 16384 by default) or
a keras-hub BERT classifier (`--model bert`); see `kmix.benchmarks.routes`.

Model FLOP/s (GPT only) follow PaLM's model-FLOPs convention (Chowdhery et
al. 2022, appendix B): per token `6 * N + 12 * layers * d_model * seq`,
where N counts the parameters that take part in matmuls (all but the two
embedding tables) and the second term is the attention products, forward
and backward, counted in full.

The step time is the median of `--rounds` timed rounds: each route alone
with a GPU (with its peak memory), interleaved without one
(`kmix.benchmarks.train_rounds`). The table, the summary line and the plot
(`--plot`: every route's speed against Keras's default float32 compile,
under a title that states the recommended route's) are
`kmix.benchmarks.train_table`'s.
"""

import argparse
import os
import time

import tensorflow as tf

import kmix
from kmix.benchmarks.common import format_table, progress
from kmix.benchmarks.routes import MODELS, recommend_on_model, rewrite_option as rewrite_key
from kmix.benchmarks.train_rounds import gpu_name, largest_batch, measure_all
from kmix.benchmarks.train_table import control_line, format_rows, plot, summary_line

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
HEADERS = ["policy", "stack", "compiled", "ms/step", "items/s", "TFLOP/s", "peak mem",
           "speed x f32", "mem x f32"]
AUTO = "auto"  # Keras's default jit_compile


def configurations(policies, jit_modes, recommendation=None, model_recommendation=None, autocast=False,
                   control=False):
    """The `(policy, stack, jit_compile)` triples one run measures, in table order.

    Args:
        policies: the policies of the keras and kmix rows (`POLICIES` by default).
        jit_modes: a list of `"auto"`, False and/or True.
        recommendation: a `kmix.Recommendation` for the `recommended` row, or None.
        model_recommendation: `kmix.recommend(model, ...)`'s, for the last row, or None.
        autocast: add the `autocast` rows (the float32 model placed by `kmix.autocast` O1-<half>):
            on for every model but the GPT, whose `kmix` rows already use kmix's layers.
        control: add the first float32 Keras route again (`keras-again`), built apart, as a control.
    """
    configs = []
    for jit in jit_modes:
        configs += [(p, "keras", jit) for p in policies]
    if control and "float32" in policies:
        configs.append(("float32", "keras-again", jit_modes[0]))
    if "float32" in policies:
        configs.append(("float32", "tf-rewrite", False))
    for jit in jit_modes:
        configs += [(p, "kmix", jit) for p in policies]
    for jit in jit_modes if autocast else []:
        configs += [(p, "autocast", jit) for p in policies if p != "float32"]
    if recommendation is not None:
        configs.append((recommendation.policy, "recommended", recommendation.jit_compile))
    if model_recommendation is not None:
        configs.append((model_recommendation.policy, "recommend(model)", model_recommendation.jit_compile))
    return configs


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
    parser.add_argument("--vocab", type=int, default=None,
                        help="GPT / gpt2-lm / bert: vocabulary size; default 2048 (gpt2-lm: 16384, bert: 8192)")
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
    parser.add_argument("--stacks", default=None,
                        help="comma-separated stacks to time (of keras, kmix, tf-rewrite, autocast); the float32 "
                        "Keras baseline always runs; default all")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=None,
                        help="time the float32 Keras route twice, built apart, and say whether the two "
                        "agree within the noise (default: on when interleaved, with float32 in --policies)")
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
    if args.vocab is None:
        args.vocab = {"gpt2-lm": 16384, "bert": 8192}.get(args.model, 2048)
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
    device = gpu_name()
    interleave = args.interleave if args.interleave is not None else device is None
    control = interleave and not args.quick if args.control is None else args.control
    configs = configurations(policies, jit_modes, recommendation, model_recommendation,
                             autocast=args.model != "gpt", control=control)
    if args.stacks is not None:
        wanted = {x.strip() for x in args.stacks.split(",") if x.strip()}
        known = {"keras", "kmix", "tf-rewrite", "autocast"}
        if not wanted or wanted - known:
            parser.error(f"--stacks accepts {', '.join(sorted(known))}; received {args.stacks!r}")
        wanted |= {"keras-again", "recommended", "recommend(model)"}
        configs = [c for c in configs if c[1] in wanted or c[:2] == ("float32", "keras")]
    where = tf.config.experimental.get_device_details(
        tf.config.list_physical_devices("GPU")[0]).get("device_name", "GPU") if device else \
        f"CPU ({kmix.device.cpu_features()['model']})"
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")  # every route traces its own step: TF's retracing warning is noise here
    try:
        results = measure_all(configs, size, args.steps, args.rounds, interleave, args.model)
    finally:
        logger.setLevel(level)
    if args.model in ("gpt", "gpt2-lm", "bert"):
        name = {"gpt": "GPT-style", "gpt2-lm": "keras-hub GPT-2 + untied Dense LM head", "bert": "keras-hub BERT classifier"}
        what = (f"{name[args.model]} training step: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
                f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}")
    elif args.model == "mobilenetv2":
        what = f"MobileNetV2 training step: {args.image}x{args.image} images, batch {args.batch}, 10 classes"
    else:
        what = f"ResNet50 training step: {args.image}x{args.image} images, batch {args.batch}, 10 classes"
    print(f"{what}; on {where}; TF32 {'on' if tf32 else 'off'}; median of {args.rounds} "
          f"{'interleaved ' if interleave else ''}rounds of {args.steps} steps")
    rows = format_rows(results)
    print(format_table(HEADERS, rows))
    print("items/s: tokens (GPT, gpt2-lm, BERT) or images (ResNet50, MobileNetV2). TFLOP/s: model FLOPs, 6 * params (without embeddings) "
          "+ 12 * layers * d_model * seq per token. speed x f32: the float32 Keras row's step time "
          "(Keras's default compile) / this one's" + (", round by round (the median ratio; the rewrite's "
          "rounds ran alone: the ratio of medians)." if interleave else "."))
    line = control_line(results)
    if line:
        print(line)
    if args.rounds > 1:
        print("Each round's ms/step, in the order timed:")
        for r in results:
            print(f"  {r['policy']}, {r['stack']}: " + " ".join(f"{s * 1e3:.0f}" for s in r["rounds"]))
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
        path = plot(results, args.plot, subtitle=f"{what}; on {where}")
        print(f"Plot saved to {os.path.abspath(path)}")
    progress(f"done in {time.perf_counter() - start:.0f} s")
    return {"results": results, "rows": rows, "recommendation": recommendation,
            "model_recommendation": model_recommendation, "max_batch": max_batch, "plot": path}


if __name__ == "__main__":
    main()
