"""`python -m kmix bench gpu`: the checks that need a GPU, in one command, within a time budget."""

import argparse
import contextlib
import datetime
import os
import re
import time
from pathlib import Path

import keras
import tensorflow as tf

from kmix.benchmarks import gpu_check, gpu_routes, gpu_tests, memory
from kmix.benchmarks.common import (add_options, bench_parser, choices, device_label, measured, progress,
                                    quiet_tf_logs, time_call)
from kmix.benchmarks.gpu_check import NO_GPU
from kmix.benchmarks.gpu_report import Report, memory_line, route_line, route_rows  # noqa: F401  (route_rows: tests)

ROUTES = (  # label, policy, stack ("recommended": kmix.autocast + kmix.wrap), TF32, jit_compile; the most telling first
    ("float32", "float32", "keras", True, True),
    ("O1 bfloat16", "O1-bfloat16", "recommended", True, True),
    ("O1 float16", "O1-float16", "recommended", True, True),
    ("mixed_float16", "mixed_float16", "keras", True, True),
    ("mixed_bfloat16", "mixed_bfloat16", "keras", True, True),
    ("kmix float32", "float32", "recommended", True, True),
    ("float32 TF32 off", "float32", "keras", False, True),
    ("O2 float16", "O2-float16", "recommended", True, True),
    ("O2 bfloat16", "O2-bfloat16", "recommended", True, True),
    ("O1 bfloat16 no XLA", "O1-bfloat16", "recommended", True, False),
)
MEMORY = ("float32", "O1", "O1 bfloat16", "O2 masters", "O2 kahan")  # names in memory.CONFIGS
SECTIONS = ("tests", "routes", "memory", "demo")
DEFAULT_SECTIONS = ("tests", "routes", "memory")
SHARES = {"tests": 0.4, "routes": 0.4, "memory": 0.15, "demo": 0.05}  # scaled to the sections run, in order
SIZES = {  # the routes' GPT: wide (matmuls dominate) and shallow (each route compiles in seconds)
    "full": {"routes": dict(layers=2, d_model=1024, heads=16, seq=512, vocab=32768, batch=16, rounds=3,
                            round_s=1.0, min_steps=5, max_steps=400),
             "memory": dict(layers=4, d_model=512, heads=8, seq=512, vocab=512, batch=16, steps=3),
             "demo_steps": 300, "demo_estimate": 60.0},
    "quick": {"routes": dict(layers=1, d_model=16, heads=2, seq=16, vocab=64, batch=2, rounds=2,
                             round_s=0.02, min_steps=2, max_steps=4),
              "memory": dict(layers=1, d_model=64, heads=2, seq=16, vocab=4096, batch=8, steps=1),
              "demo_steps": 10, "demo_estimate": 0.0},
}


class Budget:
    """The run's `seconds`: each of `sections` ends by its deadline (by `SHARES`), each item estimated by the last."""

    def __init__(self, seconds, sections=DEFAULT_SECTIONS):
        self.start, self.seconds, self.skipped = time.perf_counter(), seconds, []
        ordered = [s for s in SECTIONS if s in sections]
        self.deadlines = {s: sum(SHARES[o] for o in ordered[:i + 1]) / sum(SHARES[o] for o in ordered)
                          for i, s in enumerate(ordered)}

    def left(self, section):
        """Seconds left before `section`'s deadline."""
        return self.start + self.deadlines[section] * self.seconds - time.perf_counter()

    def allows(self, section, what, estimate):
        """Whether `what` (expected to take `estimate` s) fits in `section`'s time; records it if not."""
        if estimate <= self.left(section):
            return True
        self.skipped.append(f"{section}: {what} (about {estimate:.0f} s expected, "
                            f"{max(0.0, self.left(section)):.0f} s left)")
        progress(f"skipped for the time budget: {what}")
        return False


def _measure_each(section, items, budget, report, measure, record, line):
    """Measures each item (named by its first field) alone, within `section`'s time; records, prints, saves."""
    estimate = 0.0
    try:
        with quiet_tf_logs():
            for i, item in enumerate(items, 1):
                what = f"{section} {item[0]}"
                if not budget.allows(section, what, estimate):
                    continue
                progress(f"[{section} {i}/{len(items)}] {item[0]}")
                report.at(what)
                estimate = time_call(lambda: record.append(measure(item)), 1, warmup=0)[0]
                print(line(record[-1]), flush=True)
                report.at(None)
    finally:
        keras.config.set_dtype_policy("float32")


def run_routes(size, budget, report, routes=ROUTES):
    """Times each route alone (`gpu_routes.measure`) into `report.routes`; returns that list."""
    _measure_each("routes", routes, budget, report, lambda spec: gpu_routes.measure(spec, size), report.routes,
                  route_line)
    return report.routes


def run_demo(steps, budget, report, estimate):
    """`python -m kmix demo --steps STEPS` with its PNG beside the report; returns its results or None."""
    if not budget.allows("demo", f"the demo, {steps} steps", estimate):
        return None
    progress(f"[demo] python -m kmix demo --steps {steps}")
    from kmix import demo  # the demo's modules only when it runs

    report.at("the demo")
    try:
        result = measured(lambda: demo.main(["--steps", str(steps), "--quiet", "--out", str(report.out)]))
    finally:
        keras.config.set_dtype_policy("float32")
        report.running = None
    if "error" in result:
        report.notes.append(f"the demo failed: `{result['error']}`")
    report.demo = None if "error" in result else result
    return report.demo


def _parse(argv):
    parser = bench_parser("gpu", __doc__)
    add_options(parser, out=(os.path.join("kmix-out", "gpu"), "folder for report.md, gpu.png and pytest.log"),
                budget_s=(440.0, "seconds for the whole run (an item that would overrun is skipped)"),
                sections=(",".join(DEFAULT_SECTIONS), f"comma-separated, of {', '.join(SECTIONS)}"))
    parser.add_argument("--routes", default=None, metavar="LABELS", help="comma-separated route labels to time "
                        "(default: all, or two with --quick): " + ", ".join(r[0] for r in ROUTES))
    add_options(parser, quick="tiny sizes, two routes and two memory rows (a smoke test)")
    parser.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # for kmix's own tests
    args = parser.parse_args(argv)
    args.sections = choices(parser, "--sections", args.sections, SECTIONS)
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0; received {args.budget_s}")
    labels = [r[0] for r in ROUTES]
    args.routes = (choices(parser, "--routes", args.routes, labels) if args.routes
                   else ["float32", "O1 bfloat16"] if args.quick else labels)
    return args


def refuse_without_a_gpu(out):
    """Without a GPU: returns where there is no NVIDIA driver either; with one, says why and exits 1."""
    driver = gpu_check.nvidia_driver()
    if driver is None:
        print(NO_GPU)
        return
    message = gpu_check.why_no_gpu(driver)
    print(message, flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "report.md").write_text(f"## Not measured: no GPU seen, {datetime.date.today().isoformat()}\n\n"
                                         f"{message}\n", encoding="utf-8")
    raise SystemExit(1)


def main(argv=None):
    """Runs the GPU checks and writes the report; returns its figures (None without a GPU), exits 1 on a failure."""
    args = _parse(argv)
    if not tf.config.list_physical_devices("GPU") and not args.allow_cpu:
        return refuse_without_a_gpu(args.out)
    for device in tf.config.list_physical_devices("GPU"):  # memory growth: the tests' subprocess needs some too
        with contextlib.suppress(RuntimeError):  # initialised already: its setting stays
            tf.config.experimental.set_memory_growth(device, True)
    facts, build = gpu_check.gpu_facts(), tf.sysconfig.get_build_info()
    if facts is None:
        memory.use_a_cpu_allocator_with_statistics()
        where = f"{device_label()}, forced with --allow-cpu"
    else:  # the GPU, its compute capability, driver and CUDA versions
        driver = re.search(r"\d+\.\d+(?:\.\d+)?", gpu_check.nvidia_driver() or "")
        where = (f"{facts[0]} (compute capability {facts[1]}), driver {driver.group(0) if driver else 'unknown'}, "
                 f"CUDA {build.get('cuda_version')}, cuDNN {build.get('cudnn_version')}")
    sizes, budget = SIZES["quick" if args.quick else "full"], Budget(args.budget_s, args.sections)
    header = f"{where}, {datetime.date.today().isoformat()}"
    report = Report(args.out, header, sizes)
    report.skipped = budget.skipped  # the same list: the budget records there
    progress(f"bench gpu on {header}; budget {args.budget_s:.0f} s; sections {', '.join(budget.deadlines)}")
    report.save()
    if "tests" in args.sections:
        report.at("the tests (pytest -m gpu)")
        report.tests = gpu_tests.run_tests(budget.left("tests"), args.out)
        print(f"tests: {report.tests['summary']}", flush=True)
        report.at(None)
    if "routes" in args.sections:
        run_routes(sizes["routes"], budget, report, [r for r in ROUTES if r[0] in args.routes])
        report.save(plot=True)
    if "memory" in args.sections:  # bench memory's configurations, under XLA
        names, size = ("float32", "O1 bfloat16") if args.quick else MEMORY, sizes["memory"]
        _measure_each("memory", [c for c in memory.CONFIGS if c[0] in names], budget, report,
                      lambda c: measured(lambda: memory.measure(c, size, size["steps"], jit_compile=True), name=c[0]),
                      report.memory, memory_line)
    if "demo" in args.sections and "tests" in args.sections:
        report.notes.append("the demo section did not run: tests/test_on_gpu.py::test_demo_on_the_gpu runs the demo")
    elif "demo" in args.sections:
        run_demo(sizes["demo_steps"], budget, report, sizes["demo_estimate"])
    report.seconds = time.perf_counter() - budget.start
    png = report.save(plot=True)
    print(Path(report.path).read_text(encoding="utf-8"))
    failures = failed(report)
    print(f"Report: {os.path.abspath(report.path)}\nPlot: {os.path.abspath(png)}")
    progress(f"done in {report.seconds:.0f} s" + (f"; failed: {'; '.join(failures)}" if failures else ""))
    if failures:
        raise SystemExit(1)
    return {"routes": report.routes, "memory": report.memory, "demo": report.demo, "tests": report.tests,
            "skipped": budget.skipped, "report": report.path, "plot": png}


def failed(report):
    """What failed in `report`: the tests (asked for: failed, stopped or not run) and each row with an error."""
    t = report.tests
    return ([f"pytest -m gpu: {t['summary']}"] if t is not None and t["returncode"] != 0 else []) + [
        f"route {r['label']}" for r in report.routes if "error" in r] + [
        f"memory {r['name']}" for r in report.memory if "error" in r]
