"""`python -m kmix bench train`: one model's training step on every route a user could take, in one run."""

import argparse
import os
import time

import tensorflow as tf

from kmix.benchmarks.common import (add_options, add_size_arguments, bench_parser, check_sizes, choices, device_label,
                                    format_table, gpu_device, progress, quiet_tf_logs, recommend_here, save_plot)
from kmix.benchmarks.routes import MODELS, recommend_on_model, rewrite_option as rewrite_key
from kmix.benchmarks.train_rounds import largest_batch, measure_all
from kmix.benchmarks.train_table import control_line, format_rows, plot, summary_line

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
HEADERS = ["policy", "stack", "compiled", "ms/step", "items/s", "TFLOP/s", "peak mem", "speed x f32", "mem x f32"]
STACKS = ("autocast", "keras", "kmix", "tf-rewrite")  # what --stacks chooses among


def configurations(policies, jit_modes, recommendation=None, model_recommendation=None, autocast=False, control=False):
    """The `(policy, stack, jit_compile)` triples one run measures, in table order (`control`: `keras-again` too)."""
    configs = [(p, "keras", jit) for jit in jit_modes for p in policies]
    if control and "float32" in policies:
        configs.append(("float32", "keras-again", jit_modes[0]))
    if "float32" in policies:
        configs.append(("float32", "tf-rewrite", False))
    configs += [(p, "kmix", jit) for jit in jit_modes for p in policies]
    if autocast:
        configs += [(p, "autocast", jit) for jit in jit_modes for p in policies if p != "float32"]
    picked = ((recommendation, "recommended"), (model_recommendation, "recommend(model)"))
    return configs + [(r.policy, stack, r.jit_compile) for r, stack in picked if r is not None]


def _parse(argv):
    parser = bench_parser("train", __doc__, epilog="Defaults: matmuls dominate the step, and a 2-core CPU finishes "
                          "in about 3 minutes. A GPU-sized run: --layers 12 --d-model 768 --heads 12 --seq 1024 "
                          "--batch 16 --vocab 50304 --steps 20")
    parser.add_argument("--model", choices=MODELS, default="gpt", help="the model; default gpt")
    add_size_arguments(parser, layers=2, d_model=512, heads=8, seq=128, vocab=None, image=64, batch=8, steps=5,
                       rounds=6)
    add_options(parser, policies=(",".join(POLICIES), "comma-separated policies of the keras and kmix rows"))
    parser.add_argument("--jit", choices=["auto", "both", "on", "off"], default="auto", help="the keras and kmix "
                        "rows: Keras's default compile (auto), tf.function (off), XLA (on) or both; default auto")
    parser.add_argument("--recommended", action=argparse.BooleanOptionalAction, default=True,
                        help="add the route kmix.recommend() picks on this device (default on)")
    parser.add_argument("--recommend-model", action=argparse.BooleanOptionalAction, default=True, help="add the "
                        "route kmix.recommend(model, sample=...) picks, and print its table (default on)")
    add_options(parser, recommend_budget=(30.0, "budget_s of kmix.recommend(model, ...) (--quick: 3)"))
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                        help="TF32 float32 matmuls on compute capability 8.0+; default: TensorFlow's (on)")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None, help="build every "
                        "route first and alternate their rounds (no peak memory); default: on without a GPU")
    parser.add_argument("--stacks", default=None, help="comma-separated stacks to time, of " + ", ".join(STACKS)
                        + "; the float32 Keras baseline always runs; default all")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=None, help="time the float32 "
                        "Keras route twice, and say whether the two agree (default: on when interleaved)")
    add_options(parser, max_batch="GPT: also find the largest batch that trains, per policy (XLA), doubling from "
                "--batch then bisecting; GPU only unless --force", max_batch_limit=(2**16, "stop doubling there"),
                force="run --max-batch on a CPU anyway")
    parser.add_argument("--plot", nargs="?", const=os.path.join("kmix-out", "bench_train.png"), default=None,
                        metavar="PATH", help="save a PNG of the results (default path kmix-out/bench_train.png)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: the tiny GPT (ResNet50 32x32), batch 2, "
                        "2 steps, 1 round, a tiny probe")
    args = parser.parse_args(argv)
    args.vocab = {"gpt2-lm": 16384, "bert": 8192}.get(args.model, 2048) if args.vocab is None else args.vocab
    args.policies = choices(parser, "--policies", args.policies, POLICIES)
    args.stacks = choices(parser, "--stacks", args.stacks, STACKS) if args.stacks is not None else None
    args.recommend_budget = min(args.recommend_budget, 3.0) if args.quick else args.recommend_budget
    args.size = {**check_sizes(parser, args), "classes": 10}
    return args


def _described(args):
    """The table's first line: the model and its size."""
    name = {"gpt": "GPT-style", "gpt2-lm": "keras-hub GPT-2 + untied Dense LM head",
            "bert": "keras-hub BERT classifier", "resnet50": "ResNet50", "mobilenetv2": "MobileNetV2"}[args.model]
    if args.model in ("resnet50", "mobilenetv2"):
        return f"{name} training step: {args.image}x{args.image} images, batch {args.batch}, 10 classes"
    return (f"{name} training step: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, "
            f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}")


def main(argv=None):
    """Prints the training-step table (and the largest batches); returns the results, rows and recommendations."""
    args = _parse(argv)
    size, policies = args.size, args.policies
    if args.tf32 is not None:
        tf.config.experimental.enable_tensor_float_32_execution(args.tf32)
    jit_modes = {"auto": ["auto"], "both": [False, True], "on": [True], "off": [False]}[args.jit]
    start = time.perf_counter()
    recommendation = recommend_here(args.quick) if args.recommended else None
    probe = recommendation.probe if recommendation else None
    model_recommendation = (recommend_on_model(args.model, size, args.recommend_budget, probe)
                            if args.recommend_model else None)
    device = gpu_device()
    interleave = args.interleave if args.interleave is not None else device is None
    control = interleave and not args.quick if args.control is None else args.control
    configs = configurations(policies, jit_modes, recommendation, model_recommendation,
                             autocast=args.model != "gpt", control=control)
    if args.stacks is not None:
        wanted = set(args.stacks) | {"keras-again", "recommended", "recommend(model)"}
        configs = [c for c in configs if c[1] in wanted or c[:2] == ("float32", "keras")]
    with quiet_tf_logs():
        results = measure_all(configs, size, args.steps, args.rounds, interleave, args.model)
    what, where, rows = _described(args), device_label(), format_rows(results)
    print(f"{what}; on {where}; TF32 {'on' if tf.config.experimental.tensor_float_32_execution_enabled() else 'off'}; "
          f"median of {args.rounds} {'interleaved ' if interleave else ''}rounds of {args.steps} steps")
    print(format_table(HEADERS, rows))
    print("items/s: tokens (GPT, gpt2-lm, BERT) or images (ResNet50, MobileNetV2). TFLOP/s: model FLOPs, 6 * params "
          "(without embeddings) + 12 * layers * d_model * seq per token. speed x f32: the float32 Keras row's step "
          "time (Keras's default compile) / this one's" + (", round by round (the median ratio; the rewrite's "
          "rounds ran alone: the ratio of medians)." if interleave else "."))
    lines = [control_line(results)]
    if args.rounds > 1:
        lines += ["Each round's ms/step, in the order timed:"] + [
            f"  {r['policy']}, {r['stack']}: " + " ".join(f"{s * 1e3:.0f}" for s in r["rounds"]) for r in results]
    lines.append(recommendation)
    if model_recommendation is not None:
        lines += ["kmix.recommend(model, ...) on this model:", model_recommendation, summary_line(results)]
    if any(row["stack"] == "tf-rewrite" for row in results):
        lines.append(f"tf-rewrite: tf.config.optimizer.set_experimental_options({{{rewrite_key()!r}: True}}) "
                     "on the float32 model.")
    for line in filter(None, lines):  # not an empty control line, no recommendation
        print(line)
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
        table = [[p, f"{b}{'+' * capped}", b / base if base else "n/a"] for p, (b, capped) in max_batch.items()]
        print(format_table(["policy", "largest batch", "x f32"], table))
        if any(capped for _, capped in max_batch.values()):
            print(f"+: still fits at --max-batch-limit {args.max_batch_limit}.")
    path = args.plot and save_plot(lambda p: plot(results, p, subtitle=f"{what}; on {where}"), args.plot)
    progress(f"done in {time.perf_counter() - start:.0f} s")
    return {"results": results, "rows": rows, "recommendation": recommendation,
            "model_recommendation": model_recommendation, "max_batch": max_batch, "plot": path}
