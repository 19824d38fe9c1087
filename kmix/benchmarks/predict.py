"""`python -m kmix bench predict`: inference throughput, float32 against the half-precision routes.

The same untrained model (same seed) runs `model.predict` on one batch,
repeated, on each route of `kmix.benchmarks.routes`: float32 Keras (default
compile: the baseline), `mixed_bfloat16` Keras, float32 Keras under XLA
(`jit_compile=True`), TensorFlow's grappler rewrite of the float32 model,
and the route `kmix.recommend()` picks (`kmix.autocast` of the float32
model). Two served routes call a SavedModel's `serve` endpoint on the same
batch: Keras's own float32 export (`model.export`) and `kmix.export`'s
half-precision artifact of the float32 model; their rows add the artifact's
bytes on disk and the seconds `tf.saved_model.load` took. Models: the
GPT-style decoder of `bench train` and
`keras.applications.ResNet50(weights=None)` at a small input. Besides items
per second, each row says how far its outputs are from float32's: the
largest absolute difference and how often the top-1 class (the argmax over
the last axis) agrees.

Without a GPU the routes are built first and their timed rounds alternate,
so that drift on a shared machine hits all alike.
"""

import argparse
import os
import tempfile
import time

import numpy as np
import tensorflow as tf

import kmix
from kmix.benchmarks import routes as keras_routes
from kmix.benchmarks.common import format_table, progress, time_call
from kmix.benchmarks.routes import MODELS, Route
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
    configs += [("float32", "keras-export", False), (export_dtype(recommendation), "kmix.export", False)]
    return configs


def export_dtype(recommendation):
    """The half dtype `kmix.export` writes here: the recommended policy's, else bfloat16."""
    compute = getattr(getattr(recommendation, "policy", None), "compute_dtype", "float32")
    return compute if compute in ("float16", "bfloat16") else "bfloat16"


class Served:
    """A served route: the float32 model written as a SavedModel, loaded, its `serve` endpoint called.

    Args:
        model_name, size: the model (see `kmix.benchmarks.routes.build`).
        policy: `"float32"` for Keras's own export, the half dtype for `kmix.export`.
        stack: `"keras-export"` (`model.export`) or `"kmix.export"`.
        directory: where the artifact is written.
    """

    def __init__(self, model_name, size, policy, stack, directory):
        self.policy, self.stack, self.jit_compile = policy, stack, False
        with kmix.policy_scope("float32"):
            model, data, self.items = keras_routes.build(model_name, size, "keras")
        x, _ = next(iter(data))
        self.x = x
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


def make_route(model_name, size, policy, stack, jit_compile, directory):
    """A `Route` (a Keras model) or, for the stacks in `SERVED`, a `Served` SavedModel."""
    if stack in SERVED:
        return Served(model_name, size, policy, stack, directory)
    return Route(model_name, size, policy, stack, jit_compile)


def measure(model_name, size, configs, steps, rounds, reference=None, directory=None):
    """Predict throughput and agreement with float32 per route; one dict per route.

    Args:
        model_name, size: the model (see `kmix.benchmarks.routes.build`).
        configs: `(policy, stack, jit_compile)` triples, timed in alternating rounds.
        steps, rounds: batches per timed round; rounds (the fastest is kept).
        reference: float32 outputs to compare with; by default the first route's.
        directory: where the served routes write their artifacts (a new
            temporary directory by default).

    Returns:
        Dicts with `model`, `policy`, `stack`, `jit_compile`, `batch_seconds`
        (fastest round), `items_per_second`, `max_abs_diff`,
        `top1_agreement`, `bytes` and `load_seconds` (served routes; else
        None) and `outputs` (for the comparison).
    """
    if directory is None:
        with tempfile.TemporaryDirectory() as tmp:
            return measure(model_name, size, configs, steps, rounds, reference, tmp)
    built = []
    for i, (policy, stack, jit) in enumerate(configs, 1):
        progress(f"[{model_name} {i}/{len(configs)}] building {policy}, {stack}")
        route = make_route(model_name, size, policy, stack, jit, directory)
        route.config = (policy, stack, jit)
        route.outputs = route.predict(1)  # traces, and the outputs to compare
        route.seconds = []
        built.append(route)
    for r in range(rounds):
        progress(f"[{model_name}] timing round {r + 1}/{rounds}")
        for route in built:
            route.predict(1)  # absorbs a first call that instantiates anything again
            route.seconds.append(time_call(lambda: route.predict(steps), repeats=1, warmup=0)[0] / steps)
    reference = built[0].outputs if reference is None else reference
    results = []
    for route in built:
        step = min(route.seconds)
        results.append({
            "model": model_name,
            "policy": route.policy,
            "stack": route.stack,
            "jit_compile": route.jit_compile,
            "batch_seconds": step,
            "items_per_second": route.items / step,
            "max_abs_diff": float(np.max(np.abs(route.outputs - reference))),
            "top1_agreement": float(np.mean(route.outputs.argmax(-1) == reference.argmax(-1))),
            "bytes": getattr(route, "bytes", None),
            "load_seconds": getattr(route, "load_seconds", None),
            "config": route.config,
            "outputs": route.outputs,
        })
    return results


def format_rows(results):
    """Table rows; speed is against the float32 Keras row of the same model."""
    base = {r["model"]: r for r in reversed(results)
            if r["policy"] == "float32" and r["stack"] == "keras" and not r["jit_compile"]}
    rows = []
    for r in results:
        ref = base.get(r["model"])
        rows.append([r["model"], *_label(r).split(", "),
                     r["batch_seconds"] * 1e3, round(r["items_per_second"]),
                     ref["batch_seconds"] / r["batch_seconds"] if ref else "n/a",
                     r["max_abs_diff"], f"{r['top1_agreement']:.1%}",
                     "" if r["bytes"] is None else round(r["bytes"] / 1e6, 2),
                     "" if r["load_seconds"] is None else round(r["load_seconds"], 2)])
    return rows


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
    compiled = "SavedModel" if r["stack"] in SERVED else "XLA" if r["jit_compile"] else "tf.function"
    return f"{r['policy']}, {r['stack']}, {compiled}"


def main(argv=None):
    """Prints the inference table.

    Args:
        argv: command-line arguments (`--help` lists them); `sys.argv` by default.

    Returns:
        A dict: `results` (see `measure`), `rows` (in `HEADERS` order) and
        `recommendation` (the `kmix.Recommendation` of the recommended rows).

    Example:
        >>> from kmix.benchmarks import predict
        >>> out = predict.main(["--quick"])
    """
    parser = argparse.ArgumentParser(prog="python -m kmix bench predict", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,resnet50",
                        help="comma-separated models among " + ", ".join(MODELS) + "; default gpt,resnet50")
    parser.add_argument("--batch", type=int, default=32, help="batch size; default 32")
    parser.add_argument("--layers", type=int, default=2, help="GPT: blocks; default 2")
    parser.add_argument("--d-model", type=int, default=512, help="GPT: width; default 512")
    parser.add_argument("--heads", type=int, default=8, help="GPT: heads; default 8")
    parser.add_argument("--seq", type=int, default=128, help="GPT: sequence length; default 128")
    parser.add_argument("--vocab", type=int, default=2048, help="GPT: vocabulary; default 2048")
    parser.add_argument("--image", type=int, default=64, help="ResNet50: image side (>= 32); default 64")
    parser.add_argument("--steps", type=int, default=5, help="batches per timed round; default 5")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, the fastest is shown; default 3")
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny sizes, 1 round, a tiny probe")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        parser.error(f"--models accepts {', '.join(MODELS)}; received {args.models!r}")
    if args.quick:
        args.batch, args.layers, args.d_model, args.heads, args.seq = 2, 1, 16, 2, 16
        args.vocab, args.image, args.steps, args.rounds = 64, 32, 2, 1
    for name in ("batch", "layers", "d_model", "heads", "seq", "vocab", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; received {getattr(args, name)}")
    if args.d_model % args.heads:
        parser.error(f"--heads must divide --d-model; received --d-model {args.d_model} --heads {args.heads}")
    if args.image < 32:
        parser.error(f"--image must be >= 32 (ResNet50's smallest input); received {args.image}")
    size = {k: getattr(args, k) for k in ("batch", "layers", "d_model", "heads", "seq", "vocab", "image")}
    size["classes"] = 10
    start = time.perf_counter()
    progress("kmix.recommend(): probing this device")
    recommendation = kmix.recommend(probe=kmix.device.probe((64, 16, 32), budget=0.02) if args.quick else None)
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")
    configs = routes(recommendation)
    plain = [c for c in configs if c[1] != "tf-rewrite"]
    rewrite = [c for c in configs if c[1] == "tf-rewrite"]
    try:
        # TensorFlow's rewrite runs last, alone: once its option has been set and unset, the
        # other routes' functions ran slower for the rest of the process on our CPUs (2026-11-23).
        by_model = {m: measure(m, size, plain, args.steps, args.rounds) for m in models}
        for m in models:
            if rewrite:
                by_model[m] += measure(m, size, rewrite, args.steps, args.rounds, by_model[m][0]["outputs"])
        order = {c: i for i, c in enumerate(configs)}
        results = []
        for m in models:
            results += sorted(by_model[m], key=lambda r: order[r["config"]])
        for r in results:
            del r["outputs"], r["config"]
    finally:
        logger.setLevel(level)
    where = "GPU" if tf.config.list_physical_devices("GPU") else f"CPU ({kmix.device.cpu_features()['model']})"
    print(f"predict on {where}: batch {args.batch}; GPT {args.layers} layers, d_model {args.d_model}, seq "
          f"{args.seq}, vocab {args.vocab}; ResNet50 {args.image}x{args.image}, 10 classes; fastest of "
          f"{args.rounds} interleaved rounds of {args.steps} batches")
    rows = format_rows(results)
    print(format_table(HEADERS, rows))
    print("items/s: tokens (GPT) or images (ResNet50). max |out - f32| and top-1: against the float32 "
          "Keras outputs of the same untrained model on the same batch. Served rows (SavedModel): the "
          "endpoint called on the batch in a loop (no `model.predict` around it); MB on disk, load s: "
          "`tf.saved_model.load`.")
    for line in fastest_lines(results):
        print(line)
    print(recommendation)
    progress(f"done in {time.perf_counter() - start:.0f} s")
    return {"results": results, "rows": rows, "recommendation": recommendation}


if __name__ == "__main__":
    main()
