"""`python -m kmix bench gpu`: the checks that need a GPU, in one command, within a time budget.

kmix is built for GPU training compiled with XLA, and a GPU machine is at
hand rarely and for minutes; this command runs, in order:

1. `tests`: the tests marked `gpu` (`pytest -m gpu`, verbose, in a subprocess
   with its own slot of the budget; `kmix.benchmarks.gpu_tests`);
2. `routes`: the GPT training step of `bench train` on each route, each alone
   with its peak memory (`kmix.benchmarks.gpu_routes`): Keras float32 under
   XLA with TF32 on (the baseline), kmix's O1 bfloat16 and float16, Keras's
   `mixed_float16` and `mixed_bfloat16`, kmix at float32 (kmix's own cost),
   float32 with TF32 off, kmix's O2, and O1 bfloat16 without XLA; the most
   telling first, since the budget cuts the last;
3. `memory`: peak and resident memory of float32, O1 (float16, bfloat16)
   and O2 under XLA (`kmix.benchmarks.memory`), with `kmix.memory_report`'s
   prediction beside them;
4. `demo` (only when asked, and not with `tests`, which run it):
   `python -m kmix demo` on the GPU.

Each section ends by its deadline, a share of `--budget-s`; an item that
would not finish in time is skipped and named. Each item is measured on its
own (an error becomes its row), printed as soon as it is measured, and
`report.md` is written again after it (`kmix.benchmarks.gpu_report`), so a
run stopped at any moment leaves what it measured. Where an NVIDIA driver is
installed but TensorFlow sees no GPU, it prints TensorFlow's reason and
exits with status 1 (`kmix.benchmarks.gpu_check`); without any GPU or driver
it says so and exits 0. It exits 1 too when a test or an item failed.
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
from kmix.benchmarks.common import progress
from kmix.benchmarks.gpu_check import NO_GPU  # noqa: F401  (re-exported)
from kmix.benchmarks.gpu_report import ROUTE_HEADERS, Report, memory_line, route_line, route_rows  # noqa: F401

ROUTES = (
    # label, policy, stack ("recommended": kmix.autocast + kmix.wrap), TF32, jit_compile.
    # The most telling first: where the budget runs out, the last are skipped.
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
# Each section's share of the budget; the sections run take the whole of it between them, in
# SECTIONS' order, and a section that ends early leaves its time to the next.
SHARES = {"tests": 0.4, "routes": 0.4, "memory": 0.15, "demo": 0.05}
SIZES = {
    # The GPT of `bench train`: wide, so that matmuls dominate the step, and shallow, so that
    # each route compiles in seconds and most of them fit in the budget.
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
    """The run's time budget: each section ends by its deadline, each item is estimated by the last.

    Args:
        seconds: the whole run's.
        sections: the sections that run; their `SHARES` are scaled to fill `seconds`.
    """

    def __init__(self, seconds, sections=DEFAULT_SECTIONS):
        self.start, self.seconds = time.perf_counter(), seconds
        self.skipped = []
        ordered = [s for s in SECTIONS if s in sections]
        total, end = sum(SHARES[s] for s in ordered), 0.0
        self.deadlines = {}
        for s in ordered:
            end += SHARES[s] / total
            self.deadlines[s] = end

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
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")  # every item traces its own step
    try:
        for i, item in enumerate(items, 1):
            if not budget.allows(section, f"{section} {name(item)}", estimate):
                continue
            progress(f"[{section} {i}/{len(items)}] {name(item)}")
            report.running = f"{section} {name(item)}"
            report.save()
            started = time.perf_counter()
            result = measure(item)
            estimate = time.perf_counter() - started
            record.append(result)
            print(line(result), flush=True)
            report.running = None
            report.save()
    finally:
        logger.setLevel(level)
        keras.config.set_dtype_policy("float32")


def run_routes(size, budget, report, routes=ROUTES):
    """Times each route alone (`gpu_routes.measure`) into `report.routes`; returns that list."""
    _measure_each("routes", routes, budget, report, lambda spec: gpu_routes.measure(spec, size),
                  lambda spec: spec[0], report.routes, route_line)
    return report.routes


def measure_memory(config, size):
    """`memory.measure` of one configuration under XLA, or `{"name": ..., "error": ...}`."""
    try:
        return memory.measure(config, size, size["steps"], jit_compile=True)
    except Exception as error:  # noqa: BLE001  (the row says what went wrong; the next one runs)
        return {"name": config[0], "error": gpu_routes.describe(error)}
    finally:
        keras.config.set_dtype_policy("float32")


def run_memory(size, budget, report, names=MEMORY):
    """`bench memory`'s configurations named in `names` into `report.memory`; returns that list."""
    configs = [c for c in memory.CONFIGS if c[0] in names]
    _measure_each("memory", configs, budget, report, lambda config: measure_memory(config, size),
                  lambda config: config[0], report.memory, memory_line)
    return report.memory


def run_demo(steps, budget, report, estimate):
    """`python -m kmix demo --steps STEPS` with its PNG beside the report; returns its results or None."""
    if not budget.allows("demo", f"the demo, {steps} steps", estimate):
        return None
    progress(f"[demo] python -m kmix demo --steps {steps}")
    from kmix import demo  # the demo's modules only when it runs

    report.running = "the demo"
    report.save()
    try:
        report.demo = demo.main(["--steps", str(steps), "--quiet", "--out", str(report.out)])
    except Exception as error:  # noqa: BLE001
        report.notes.append(f"the demo failed: `{gpu_routes.describe(error)}`")
    finally:
        keras.config.set_dtype_policy("float32")
        report.running = None
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
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not args.sections or set(args.sections) - set(SECTIONS):
        parser.error(f"--sections accepts {', '.join(SECTIONS)}; received {','.join(args.sections)!r}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0; received {args.budget_s}")
    labels = [r.strip() for r in args.routes.split(",")] if args.routes else None
    if labels and set(labels) - {r[0] for r in ROUTES}:
        parser.error(f"--routes accepts {', '.join(r[0] for r in ROUTES)}; received {args.routes!r}")
    args.routes = labels or (["float32", "O1 bfloat16"] if args.quick else [r[0] for r in ROUTES])
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

    Args:
        argv: command-line arguments (`--help` lists them); `sys.argv` by default.

    Returns:
        None without a GPU (unless `--allow-cpu`); else a dict: `routes`, `memory` (result dicts),
        `demo` (the demo's results or None), `tests` (see `gpu_tests.run_tests`), `skipped` (what
        the budget left out), `report` and `plot` (paths). Exits with status 1 (`SystemExit`)
        instead, after writing the report, when something failed (`failed`).

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
        report.running = "the tests (pytest -m gpu)"
        report.save()
        report.tests = gpu_tests.run_tests(budget.left("tests"), args.out)
        report.running = None
        print(f"tests: {report.tests['summary']}", flush=True)
        report.save()
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
    out = []
    t = report.tests
    if t is not None and t["returncode"] != 0:  # failed, stopped, or not run (no pytest, no time)
        out.append(f"pytest -m gpu: {t['summary']}")
    out += [f"route {r['label']}" for r in report.routes if "error" in r]
    out += [f"memory {r['name']}" for r in report.memory if "error" in r]
    return out


if __name__ == "__main__":
    main()
