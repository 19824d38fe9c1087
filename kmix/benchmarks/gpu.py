"""`python -m kmix bench gpu`: the checks that need a GPU, in one command, within a time budget.

kmix is built for GPU training compiled with XLA, and a GPU machine is at
hand rarely and for minutes; this command runs, in order:

1. `routes`: the GPT training step of `bench train` on every route under XLA,
   each alone with its peak memory: float32 with tensor-core TF32 on and off
   (`tf.config.experimental.enable_tensor_float_32_execution`), plain Keras
   `mixed_float16` / `mixed_bfloat16`, and `kmix.autocast` + `kmix.wrap` at
   O1 and O2 in float16 and bfloat16 (`kmix.benchmarks.train_rounds`);
2. `memory`: peak and resident memory of float32, O1 (float16, bfloat16)
   and O2 under XLA (`kmix.benchmarks.memory`), with `kmix.memory_report`'s
   prediction beside them;
3. `demo`: `python -m kmix demo` (the float16 NaN of a hand-written -1e9
   mask, and kmix's fix) on the GPU;
4. `tests`: the tests marked `gpu` (`pytest -m gpu`), in a subprocess.

Each section has a share of `--budget-s` (440 s by default, so that the whole
run, TensorFlow's start included, stays under 8 minutes); a step that would not finish in its section's
time is skipped and named in the report. The report (`kmix.benchmarks.gpu_report`) is one markdown
file (`report.md`, tables to paste into `docs/benchmarks.md`) and one PNG
(`gpu.png`: speed and peak memory against float32) in `--out`
(`kmix-out/gpu/`). Without a GPU it says so and returns (exit status 0).
"""

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import keras
import tensorflow as tf

import kmix
from kmix.benchmarks import memory, train_rounds
from kmix.benchmarks.common import progress
from kmix.benchmarks.gpu_report import ROUTE_HEADERS, route_rows, write_report  # noqa: F401  (re-exported)

ROUTES = (
    # label, policy, stack (train_rounds' "recommended" stack is kmix.autocast + kmix.wrap), TF32.
    # The most telling first: where the budget runs out, the last are skipped.
    ("float32", "float32", "keras", True),
    ("O1 bfloat16", "O1-bfloat16", "recommended", True),
    ("mixed_bfloat16", "mixed_bfloat16", "keras", True),
    ("float32 TF32 off", "float32", "keras", False),
    ("O2 bfloat16", "O2-bfloat16", "recommended", True),
    ("O1 float16", "O1-float16", "recommended", True),
    ("mixed_float16", "mixed_float16", "keras", True),
    ("O2 float16", "O2-float16", "recommended", True),
)
MEMORY = ("float32", "O1", "O1 bfloat16", "O2 masters", "O2 kahan")  # names in memory.CONFIGS
SECTIONS = ("routes", "memory", "demo", "tests")
# Where each section must end, as a fraction of the budget from the start; a section that ends
# early leaves its time to the next.
DEADLINES = {"routes": 0.45, "memory": 0.58, "demo": 0.66, "tests": 1.0}
NO_GPU = ("No GPU is visible to TensorFlow, so `python -m kmix bench gpu` has nothing to measure here "
          "(it runs the checks that need a GPU). `python -m kmix doctor` says why a GPU is not seen.")
SIZES = {
    # The GPT of `bench train`: wide, so that matmuls dominate the step, and shallow, so that
    # each route compiles in seconds and all of them fit in the budget.
    "full": {"routes": dict(layers=2, d_model=1024, heads=16, seq=512, vocab=32768, batch=16, steps=10, rounds=3),
             "memory": dict(layers=4, d_model=512, heads=8, seq=512, vocab=512, batch=16, steps=3),
             "demo_steps": 300, "demo_estimate": 60.0},
    "quick": {"routes": dict(layers=1, d_model=16, heads=2, seq=16, vocab=64, batch=2, steps=2, rounds=1),
              "memory": dict(layers=1, d_model=64, heads=2, seq=16, vocab=4096, batch=8, steps=1),
              "demo_steps": 10, "demo_estimate": 0.0},
}


class Budget:
    """The run's time budget: each section ends by its deadline, each step is estimated by the last."""

    def __init__(self, seconds):
        self.start, self.seconds = time.perf_counter(), seconds
        self.skipped = []

    def left(self, section):
        """Seconds left before `section`'s deadline."""
        return self.start + DEADLINES[section] * self.seconds - time.perf_counter()

    def allows(self, section, what, estimate):
        """Whether `what` (expected to take `estimate` s) fits in `section`'s time; records it if not."""
        if estimate <= self.left(section):
            return True
        self.skipped.append(f"{section}: {what} (about {estimate:.0f} s expected, "
                            f"{max(0.0, self.left(section)):.0f} s left)")
        progress(f"skipped for the time budget: {what}")
        return False


def gpu_facts():
    """`(name, compute capability)` of the first GPU, or None without one."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    details = tf.config.experimental.get_device_details(gpus[0])
    cc = details.get("compute_capability")
    return details.get("device_name", "GPU"), (f"{cc[0]}.{cc[1]}" if cc else "unknown")


def grow_gpu_memory():
    """Lets TensorFlow take GPU memory as it needs it, so that the tests' subprocess finds some."""
    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:  # the GPU was initialised already: its setting stays
            pass


def run_routes(size, budget, routes=ROUTES):
    """Times `bench train`'s step on each route under XLA, each alone; returns one dict per route."""
    results, estimate = [], 0.0
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")  # every route traces its own step
    try:
        for i, (label, policy, stack, use_tf32) in enumerate(routes, 1):
            if not budget.allows("routes", f"route {label}", estimate):
                continue
            progress(f"[routes {i}/{len(routes)}] {label}")
            started = time.perf_counter()
            tf.config.experimental.enable_tensor_float_32_execution(use_tf32)
            row = train_rounds.measure((policy, stack, True), size, size["steps"], size["rounds"])
            row.update(label=label, stack="keras" if stack == "keras" else "kmix.autocast", tf32=use_tf32)
            results.append(row)
            estimate = time.perf_counter() - started
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
        logger.setLevel(level)
        keras.config.set_dtype_policy("float32")
    return results


def run_memory(size, budget, names=MEMORY):
    """`bench memory`'s configurations named in `names`, under XLA; returns its result dicts."""
    results, estimate = [], 0.0
    configs = [c for c in memory.CONFIGS if c[0] in names]
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")
    try:
        for i, config in enumerate(configs, 1):
            if not budget.allows("memory", f"memory {config[0]}", estimate):
                continue
            progress(f"[memory {i}/{len(configs)}] {config[0]}")
            started = time.perf_counter()
            results.append(memory.measure(config, size, size["steps"], jit_compile=True))
            estimate = time.perf_counter() - started
    finally:
        logger.setLevel(level)
        keras.config.set_dtype_policy("float32")
    return results


def run_demo(steps, out, budget, estimate):
    """`python -m kmix demo --steps STEPS` with its PNG in `out`; returns its results, or None if skipped."""
    if not budget.allows("demo", f"the demo, {steps} steps", estimate):
        return None
    progress(f"[demo] python -m kmix demo --steps {steps}")
    from kmix import demo  # the demo's modules only when it runs

    try:
        return demo.main(["--steps", str(steps), "--quiet", "--out", str(out)])
    finally:
        keras.config.set_dtype_policy("float32")


def gpu_test_files(root):
    """The test files under `root` that mark a test `gpu`, as paths relative to `root`'s parent."""
    return sorted(str(p.relative_to(root.parent)) for p in root.rglob("test_*.py")
                  if "mark.gpu" in p.read_text(encoding="utf-8"))


def run_tests(budget, root=None):
    """`pytest -m gpu` on the files that hold such tests, in a subprocess within the budget.

    Returns:
        A dict: `command`, `summary` (pytest's last line, e.g. `"5 passed in 41.2s"`, or why
        nothing ran), `returncode` (None if not run or timed out), `tail` (the last lines of its output).
    """
    root = Path(root) if root else Path(kmix.__file__).resolve().parents[1] / "tests"
    if not root.is_dir():
        return {"command": None, "summary": f"not run: no tests folder at {root} (run from a clone of kmix)",
                "returncode": None, "tail": ""}
    files = gpu_test_files(root)
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    timeout = budget.left("tests")
    if not files or timeout < 20:
        why = "no test file marks a test gpu" if not files else f"{max(0.0, timeout):.0f} s left in the budget"
        budget.skipped.append(f"tests: pytest -m gpu ({why})")
        return {"command": command, "summary": f"not run: {why}", "returncode": None, "tail": ""}
    progress(f"[tests] {' '.join(command[1:])} (timeout {timeout:.0f} s)")
    env = {**os.environ, "TF_FORCE_GPU_ALLOW_GROWTH": "true",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root.parent), os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run(command, cwd=root.parent, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"command": command, "summary": f"timed out after {timeout:.0f} s", "returncode": None,
                "tail": _tail(out)}
    return {"command": command, "summary": pytest_summary(done.stdout), "returncode": done.returncode,
            "tail": _tail(done.stdout + done.stderr)}


def pytest_summary(output):
    """pytest's summary line (`"3 passed, 1 skipped in 12.34s"`), without its `=` rule; "" if none."""
    for line in reversed(output.strip().splitlines()):
        match = re.search(r"(\d+ (?:passed|failed|skipped|deselected|error|errors|xfailed|xpassed|warnings?)"
                          r".* in [\d.]+s(?: \([\d:]+\))?)", line)
        if match:
            return match.group(1)
        if "no tests ran" in line:
            return line.strip("= ")
    return ""


def _tail(text, lines=15):
    return "\n".join(text.strip().splitlines()[-lines:])


def main(argv=None):
    """Runs the GPU checks and writes the report; without a GPU, says so and returns None.

    Args:
        argv: command-line arguments (`--help` lists them); `sys.argv` by default.

    Returns:
        None without a GPU (unless `--allow-cpu`); else a dict: `routes`, `memory` (result dicts),
        `demo` (the demo's results or None), `tests` (see `run_tests`), `skipped` (what the budget
        left out), `report` and `plot` (paths).

    Example:
        >>> from kmix.benchmarks import gpu
        >>> out = gpu.main([])  # on a GPU machine: kmix-out/gpu/report.md and gpu.png
    """
    parser = argparse.ArgumentParser(prog="python -m kmix bench gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("kmix-out", "gpu"),
                        help="folder for report.md and gpu.png, created if missing; default kmix-out/gpu")
    parser.add_argument("--budget-s", type=float, default=440.0,
                        help="seconds for the whole run (a step that would overrun is skipped); default 440")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated sections to run; default " + ",".join(SECTIONS))
    parser.add_argument("--routes", default=None, metavar="LABELS",
                        help="comma-separated route labels to time (default: all, or two with --quick): "
                        + ", ".join(r[0] for r in ROUTES))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, two routes and two memory rows (a smoke test)")
    parser.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # for kmix's own tests
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not sections or set(sections) - set(SECTIONS):
        parser.error(f"--sections accepts {', '.join(SECTIONS)}; received {args.sections!r}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0; received {args.budget_s}")
    if not tf.config.list_physical_devices("GPU") and not args.allow_cpu:
        print(NO_GPU)
        return None
    grow_gpu_memory()  # before anything starts the GPU: the tests' subprocess needs memory too
    facts = gpu_facts()
    if facts is None:
        where = f"CPU ({kmix.device.cpu_features()['model']}), forced with --allow-cpu"
        memory.use_a_cpu_allocator_with_statistics()
    else:
        where = f"{facts[0]} (compute capability {facts[1]})"
    sizes = SIZES["quick" if args.quick else "full"]
    labels = [r.strip() for r in args.routes.split(",")] if args.routes else None
    if labels and set(labels) - {r[0] for r in ROUTES}:
        parser.error(f"--routes accepts {', '.join(r[0] for r in ROUTES)}; received {args.routes!r}")
    labels = labels or (["float32", "O1 bfloat16"] if args.quick else [r[0] for r in ROUTES])
    routes_to_run = [r for r in ROUTES if r[0] in labels]
    memory_to_run = ("float32", "O1 bfloat16") if args.quick else MEMORY
    budget = Budget(args.budget_s)
    header = f"{where}, {datetime.date.today().isoformat()}"
    progress(f"bench gpu on {where}; budget {args.budget_s:.0f} s; sections {', '.join(sections)}")
    routes = run_routes(sizes["routes"], budget, routes_to_run) if "routes" in sections else []
    mem = run_memory(sizes["memory"], budget, memory_to_run) if "memory" in sections else []
    demo_results = None
    if "demo" in sections:
        demo_results = run_demo(sizes["demo_steps"], args.out, budget, sizes["demo_estimate"])
    tests = run_tests(budget) if "tests" in sections else {"command": None, "summary": "not run",
                                                              "returncode": None, "tail": ""}
    seconds = time.perf_counter() - budget.start
    report, png = write_report(args.out, header, routes, sizes["routes"], mem, sizes["memory"], demo_results,
                               tests, budget.skipped, seconds)
    print(Path(report).read_text())
    if tests["tail"] and tests["returncode"] not in (0, None):
        print("pytest -m gpu, last lines:\n" + tests["tail"])
    print(f"Report: {os.path.abspath(report)}\nPlot: {os.path.abspath(png)}")
    progress(f"done in {seconds:.0f} s")
    return {"routes": routes, "memory": mem, "demo": demo_results, "tests": tests, "skipped": budget.skipped,
            "report": report, "plot": png}


if __name__ == "__main__":
    main()
