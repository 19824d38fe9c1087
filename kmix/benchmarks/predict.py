"""`python -m kmix bench predict`: inference throughput, float32 against the half-precision routes."""

import os
import tempfile
import time

import numpy as np
import tensorflow as tf

import kmix
from kmix.benchmarks.common import (add_options, add_size_arguments, alternate, bench_parser, check_sizes, choices,
                                    compiled, device_label, format_table, progress, quiet_tf_logs, recommend_here)
from kmix.benchmarks.routes import MODELS, Route, build
from kmix.serving import artifact

HEADERS = ["model", "policy", "stack", "compiled", "ms/batch", "items/s", "speed x f32", "max |out - f32|",
           "top-1 = f32", "MB", "load s"]
SERVED = ("keras-export", "kmix.export")  # stacks that serve a SavedModel rather than a Keras model


def routes(recommendation):
    """The `(policy, stack, jit_compile)` triples measured per model, baseline first."""
    configs = [("float32", "keras", "auto"), ("mixed_bfloat16", "keras", "auto"), ("float32", "keras", True),
               ("float32", "tf-rewrite", False)]
    if recommendation is not None:
        configs.append((recommendation.policy, "recommended", recommendation.jit_compile))
    compute = "float32" if recommendation is None else kmix.Policy(recommendation.policy).compute_dtype  # export's
    return configs + [("float32", "keras-export", False),
                      (compute if compute in ("float16", "bfloat16") else "bfloat16", "kmix.export", False)]


class Served:
    """The float32 model exported by `model.export` or `kmix.export` (in `policy`), loaded; `predict` calls `serve`."""

    def __init__(self, model_name, size, policy, stack, directory):
        self.policy, self.stack, self.jit_compile = policy, stack, False
        with kmix.policy_scope("float32"):
            model, data, self.items = build(model_name, size, "keras")
        self.x = x = next(iter(data))[0]
        path = os.path.join(directory, f"{model_name}-{stack}")
        if stack == "keras-export":
            model.export(path, format="tf_saved_model", verbose=False)
        else:
            kmix.export(model, path, dtype=policy, sample=x.numpy(), verbose=False)
        self.bytes = artifact.disk_bytes(path)
        start = time.perf_counter()
        self._loaded = tf.saved_model.load(path)  # kept: the endpoint reads its variables
        self.load_seconds = time.perf_counter() - start

    def predict(self, steps):
        """Calls `serve` on the batch `steps` times; returns the last outputs as float32 NumPy."""
        for _ in range(steps):
            out = self._loaded.serve(self.x)
        return np.asarray(out, dtype=np.float32)


def measure(model_name, size, configs, steps, rounds, reference=None, directory=None):
    """A dict per route of `configs`: predict throughput (the fastest round) and agreement with `reference`."""
    if directory is None:
        with tempfile.TemporaryDirectory() as tmp:
            return measure(model_name, size, configs, steps, rounds, reference, tmp)
    built = []
    for i, (policy, stack, jit) in enumerate(configs, 1):
        progress(f"[{model_name} {i}/{len(configs)}] building {policy}, {stack}")
        route = (Served(model_name, size, policy, stack, directory) if stack in SERVED
                 else Route(model_name, size, policy, stack, jit))
        route.config = (policy, stack, jit)
        route.outputs = route.predict(1)  # traces, and the outputs to compare
        built.append(route)
    # Each round: one untimed batch first (it absorbs a first call that instantiates anything again).
    seconds = alternate({i: (lambda r=route: r.predict(steps)) for i, route in enumerate(built)}, rounds, warmup=0,
                        after_round=lambda r, _: progress(f"[{model_name}] timed round {r + 1}/{rounds}"),
                        before=lambda i: built[i].predict(1))
    reference = built[0].outputs if reference is None else reference
    return [{"model": model_name, "policy": route.policy, "stack": route.stack, "jit_compile": route.jit_compile,
             "batch_seconds": min(seconds[i]) / steps, "items_per_second": route.items * steps / min(seconds[i]),
             "max_abs_diff": float(np.max(np.abs(route.outputs - reference))),
             "top1_agreement": float(np.mean(route.outputs.argmax(-1) == reference.argmax(-1))),
             "bytes": getattr(route, "bytes", None), "load_seconds": getattr(route, "load_seconds", None),
             "config": route.config, "outputs": route.outputs} for i, route in enumerate(built)]


def format_rows(results):
    """Table rows; speed is against the float32 Keras row of the same model."""
    base = {r["model"]: r for r in reversed(results)
            if r["policy"] == "float32" and r["stack"] == "keras" and not r["jit_compile"]}
    return [[r["model"], *_label(r).split(", "), r["batch_seconds"] * 1e3, round(r["items_per_second"]),
             base[r["model"]]["batch_seconds"] / r["batch_seconds"] if r["model"] in base else "n/a",
             r["max_abs_diff"], f"{r['top1_agreement']:.1%}", "" if r["bytes"] is None else round(r["bytes"] / 1e6, 2),
             "" if r["load_seconds"] is None else round(r["load_seconds"], 2)] for r in results]


def fastest_lines(results):
    """Per model: the fastest route, and `kmix.export`'s artifact against the fastest Keras model route."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == model]
        best = min(rows, key=lambda r: r["batch_seconds"])
        lines.append(f"{model}: fastest route here: {_label(best)}")
        served = [r for r in rows if r["stack"] == "kmix.export"]
        keras_rows = [r for r in rows if r["stack"] not in SERVED]
        if served and keras_rows:
            top = min(keras_rows, key=lambda r: r["batch_seconds"])
            lines.append(f"{model}: kmix.export's artifact at {top['batch_seconds'] / served[0]['batch_seconds']:.2f}x "
                         f"the speed of the fastest Keras route ({_label(top)})")
    return lines


def _label(r):
    return f"{r['policy']}, {r['stack']}, {'SavedModel' if r['stack'] in SERVED else compiled(r['jit_compile'])}"


def main(argv=None):
    """Prints the inference table; returns `{"results": ..., "rows": ..., "recommendation": ...}`."""
    parser = bench_parser("predict", __doc__)
    add_options(parser, models=("gpt,resnet50", "comma-separated models among " + ", ".join(MODELS)))
    add_size_arguments(parser, batch=32, layers=2, d_model=512, heads=8, seq=128, vocab=2048, image=64, steps=5,
                       rounds=3)
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny sizes, 1 round, a tiny probe")
    args = parser.parse_args(argv)
    models, size = choices(parser, "--models", args.models, MODELS), {**check_sizes(parser, args), "classes": 10}
    start = time.perf_counter()
    recommendation = recommend_here(args.quick)
    configs = routes(recommendation)
    with quiet_tf_logs():
        # TensorFlow's rewrite runs last, alone (see `train_rounds.measure_all`).
        by_model = {m: measure(m, size, [c for c in configs if c[1] != "tf-rewrite"], args.steps, args.rounds)
                    for m in models}
        for m in models:
            by_model[m] += measure(m, size, [c for c in configs if c[1] == "tf-rewrite"], args.steps, args.rounds,
                                   by_model[m][0]["outputs"])
    results = [r for m in models for r in sorted(by_model[m], key=lambda r: configs.index(r["config"]))]
    for r in results:
        del r["outputs"], r["config"]
    print(f"predict on {device_label()}: batch {args.batch}; GPT {args.layers} layers, d_model {args.d_model}, seq "
          f"{args.seq}, vocab {args.vocab}; ResNet50 {args.image}x{args.image}, 10 classes; fastest of "
          f"{args.rounds} interleaved rounds of {args.steps} batches")
    rows = format_rows(results)
    print(format_table(HEADERS, rows))
    print("items/s: tokens (GPT) or images (ResNet50). max |out - f32| and top-1: against the float32 Keras outputs of "
          "the same untrained model on the same batch. Served rows (SavedModel): the endpoint called on the batch in a "
          "loop (no `model.predict` around it); MB on disk, load s: `tf.saved_model.load`.")
    print(*fastest_lines(results), recommendation, sep="\n")
    progress(f"done in {time.perf_counter() - start:.0f} s")
    return {"results": results, "rows": rows, "recommendation": recommendation}
