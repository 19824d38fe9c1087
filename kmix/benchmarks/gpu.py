"""`python -m kmix bench gpu`: the checks that need a GPU, in one command, within a time budget.

Sections, in order, each by its share of `--budget-s`: `tests` (`pytest -m gpu`), `routes` (the GPT training
step on each route, alone), `memory` (`bench memory`'s configurations under XLA) and, when asked, `demo`.
Each item prints as measured and `report.md` is rewritten after it, so a stopped run leaves what it measured.
Exits 1 where a driver is installed but TensorFlow sees no GPU (saying why), or where a test or an item failed.
"""

import argparse
import datetime
import os
import re
import time
from pathlib import Path

import keras
import tensorflow as tf

import kmix
from kmix.benchmarks import gpu_check, gpu_routes, gpu_tests, memory
from kmix.benchmarks.common import choices, measured, progress, quiet_tf_logs
from kmix.benchmarks.gpu_check import NO_GPU  # noqa: F401  (re-exported)
from kmix.benchmarks.gpu_report import ROUTE_HEADERS, Report, memory_line, route_line, route_rows  # noqa: F401

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
        self.start, self.seconds, self.skipped, self.deadlines = time.perf_counter(), seconds, [], {}
        ordered = [s for s in SECTIONS if s in sections]
        for i, s in enumerate(ordered):
            self.deadlines[s] = sum(SHARES[o] for o in ordered[:i + 1]) / sum(SHARES[o] for o in ordered)

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


def _measure_each(section, items, budget, report, measure, name, record, line):
    """Measures each item alone, within `section`'s time; records, prints and saves after each."""
    estimate = 0.0
    try:
        with quiet_tf_logs():
            for i, item in enumerate(items, 1):
                if not budget.allows(section, f"{section} {name(item)}", estimate):
                    continue
                progress(f"[{section} {i}/{len(items)}] {name(item)}")
                report.at(f"{section} {name(item)}")
                started = time.perf_counter()
                record.append(measure(item))
                estimate = time.perf_counter() - started
                print(line(record[-1]), flush=True)
                report.at(None)
    finally:
        keras.config.set_dtype_policy("float32")


def run_routes(size, budget, report, routes=ROUTES):
    """Times each route alone (`gpu_routes.measure`) into `report.routes`; returns that list."""
    _measure_each("routes", routes, budget, report, lambda spec: gpu_routes.measure(spec, size),
                  lambda spec: spec[0], report.routes, route_line)
    return report.routes


def run_memory(size, budget, report, names=MEMORY):
    """`bench memory`'s configurations named in `names`, under XLA, into `report.memory`; returns that list."""
    _measure_each("memory", [c for c in memory.CONFIGS if c[0] in names], budget, report,
                  lambda c: measured(lambda: memory.measure(c, size, size["steps"], jit_compile=True), name=c[0]),
                  lambda c: c[0], report.memory, memory_line)
    return report.memory


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


def where_it_runs():
    """The device line of the report: the GPU, its compute capability, driver and CUDA versions."""
    facts = gpu_check.gpu_facts()
    if facts is None:
        return f"CPU ({kmix.device.cpu_features()['model']}), forced with --allow-cpu"
    driver = re.search(r"\d+\.\d+(?:\.\d+)?", gpu_check.nvidia_driver() or "")
    build = tf.sysconfig.get_build_info()
    return (f"{facts[0]} (compute capability {facts[1]}), driver {driver.group(0) if driver else 'unknown'}, "
            f"CUDA {build.get('cuda_version')}, cuDNN {build.get('cudnn_version')}")


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m kmix bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("kmix-out", "gpu"),
                        help="folder for report.md, gpu.png and pytest.log, created if missing; default kmix-out/gpu")
    parser.add_argument("--budget-s", type=float, default=440.0,
                        help="seconds for the whole run (an item that would overrun is skipped); default 440")
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)}; default {','.join(DEFAULT_SECTIONS)}")
    parser.add_argument("--routes", default=None, metavar="LABELS",
                        help="comma-separated route labels to time (default: all, or two with --quick): "
                        + ", ".join(r[0] for r in ROUTES))
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, two routes and two memory rows (a smoke test)")
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
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(f"## Not measured: no GPU seen, {datetime.date.today().isoformat()}\n\n{message}\n")
    raise SystemExit(1)


def main(argv=None):
    """Runs the GPU checks and writes the report; without a GPU, says so (exit status 1 where a driver is).

    Returns:
        None without a GPU; else `{"routes", "memory", "demo", "tests", "skipped", "report", "plot"}`.
        Raises `SystemExit(1)` after writing the report when something failed.

    Example:
        >>> from kmix.benchmarks import gpu
        >>> out = gpu.main([])  # on a GPU machine: kmix-out/gpu/report.md, gpu.png and pytest.log
    """
    args = _parse(argv)
    if not tf.config.list_physical_devices("GPU") and not args.allow_cpu:
        return refuse_without_a_gpu(args.out)
    gpu_check.grow_gpu_memory()  # before anything starts the GPU: the tests' subprocess needs memory too
    if gpu_check.gpu_facts() is None:
        memory.use_a_cpu_allocator_with_statistics()
    sizes = SIZES["quick" if args.quick else "full"]
    budget = Budget(args.budget_s, args.sections)
    header = f"{where_it_runs()}, {datetime.date.today().isoformat()}"
    report = Report(args.out, header, sizes)
    report.skipped = budget.skipped
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
    if "memory" in args.sections:
        run_memory(sizes["memory"], budget, report, ("float32", "O1 bfloat16") if args.quick else MEMORY)
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
