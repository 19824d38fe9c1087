"""`python -m kmix bench profile`: where each route's training step spends its time, per op type."""

import collections
import glob
import os
import tempfile

import tensorflow as tf

from kmix import _compat
from kmix.benchmarks.common import add_size_arguments, bench_parser, check_sizes, choices, format_table, progress
from kmix.benchmarks.routes import Route

ROUTES = {"f32": ("float32", "keras", "auto"), "keras-bf16": ("mixed_bfloat16", "keras", "auto"),
          "kmix-bf16": ("mixed_bfloat16", "kmix", "auto"), "tf-rewrite": ("float32", "tf-rewrite", False),
          "autocast-O1-bf16": ("O1-bfloat16", "recommended", False)}  # the last: what kmix.recommend() picks here
CATEGORIES = {  # op type prefixes of each category; anything else is "other"
    "matmul": ("MatMul", "BatchMatMul", "Einsum", "Conv"), "cast": ("Cast",),
    "optimizer": ("Assign", "ApplyAdam", "ResourceApply"), "finite check": ("IsFinite", "All"),
    "softmax / exp": ("Softmax", "Exp", "Max", "DivNoNan", "SelectV2", "Select"), "gelu": ("Erf", "Erfc", "Tanh"),
    "norm / reductions": ("Mean", "Sum", "SquaredDifference", "Rsqrt", "Sqrt", "FusedBatchNorm"),
}


def op_times(xplane_path, steps):
    """`{op type: ms per step}` from one trace file (ops on the executor's threads)."""
    space = _compat.xplane_proto().XSpace()
    with open(xplane_path, "rb") as f:
        space.ParseFromString(f.read())
    times = collections.Counter()
    for plane in (p for p in space.planes if p.name.startswith("/host:")):
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in (line for line in plane.lines if line.name.startswith("tf_Compute")):
            for event in line.events:
                name = names.get(event.metadata_id, "")
                if ":" in name and "::" not in name:  # "layer/op_name:OpType" (oneDNN's: _MklOpType)
                    times[name.rsplit(":", 1)[1].removeprefix("_Mkl")] += event.duration_ps / 1e9 / steps
    return times


def profile_route(name, size, steps, logdir):
    """Traces `steps` steps of route `name`; returns its `{op type: ms per step}`."""
    route = Route("gpt", size, *ROUTES[name])
    route.train(2)  # traced and warm
    path = os.path.join(logdir, name)
    tf.profiler.experimental.start(path)
    try:
        route.train(steps)
    finally:
        tf.profiler.experimental.stop()
    (trace,) = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
    return op_times(trace, steps)


def tables(profiles, top):
    """`(op rows, category rows)`: ms per step per route and the ratio of each to the first."""
    names, total = list(profiles), collections.Counter()
    for times in profiles.values():
        total.update(times)
    ops = [op for op, _ in total.most_common(top)]

    def row(label, values):
        return [label] + values + [values[0] / v if v else "n/a" for v in values[1:]]

    op_rows = [row(op, [profiles[n].get(op, 0.0) for n in names]) for op in ops]
    by_category = {n: collections.Counter() for n in names}
    for n in names:
        for op, ms in profiles[n].items():
            by_category[n][next((c for c, prefixes in CATEGORIES.items() if op.startswith(prefixes)), "other")] += ms
    cat_rows = [row(c, [by_category[n][c] for n in names]) for c in [*CATEGORIES, "other"]] + [
        row("all ops", [sum(profiles[n].values()) for n in names])]
    return op_rows, cat_rows


def main(argv=None):
    """Prints the op-type and category tables; returns `{"profiles": {route: {op: ms}}, "ops", "categories"}`."""
    parser = bench_parser("profile", __doc__)
    parser.add_argument("--routes", default="f32,keras-bf16,kmix-bf16",
                        help="comma-separated, among " + ", ".join(ROUTES) + "; the first is the reference")
    add_size_arguments(parser, layers=2, d_model=512, heads=8, seq=128, batch=8, vocab=2048, steps=5)
    parser.add_argument("--top", type=int, default=20, help="op types shown; default 20")
    parser.add_argument("--logdir", default=None, help="keep the traces here (TensorBoard's profile tab reads them)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: tiny sizes, 2 steps")
    args = parser.parse_args(argv)
    names, size, profiles = choices(parser, "--routes", args.routes, ROUTES), check_sizes(parser, args), {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names, 1):
            progress(f"[{i}/{len(names)}] tracing {args.steps} steps of {name}")
            profiles[name] = profile_route(name, size, args.steps, args.logdir or tmp)
    op_rows, cat_rows = tables(profiles, args.top)
    ratio_headers = [f"{names[0]} / {n}" for n in names[1:]]
    print(f"GPT-style training step, {args.layers} layers, d_model {args.d_model}, seq {args.seq}, batch "
          f"{args.batch}: TensorFlow op time per step (ms), by op type (oneDNN's _Mkl ops under their op's name)")
    print(format_table(["op type"] + names + ratio_headers, op_rows) + "\n")
    print(format_table(["category"] + names + ratio_headers, cat_rows))
    return {"profiles": profiles, "ops": op_rows, "categories": cat_rows}
