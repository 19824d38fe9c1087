"""`bench gpu`'s tests section: `pytest -m gpu` in a subprocess, verbose and unbuffered into `pytest.log`."""

import collections
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import kmix

PYTEST_ARGS = ("-v", "-rA", "--durations=0", "-m", "gpu", "-p", "no:cacheprovider")
MIN_SECONDS = 20  # fewer left than this: the tests are not started
_OUTCOME = re.compile(r"^(?P<test>\S+::\S+) (?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_STARTED = re.compile(r"^(?P<test>\S+\.py::\S+) ")
_MARKED = re.compile(r"^(?:pytestmark\s*=.*\bpytest\.mark\.gpu\b|\s*@pytest\.mark\.gpu\b)", re.MULTILINE)
_DURATION = re.compile(r"^(?P<seconds>\d+(?:\.\d+)?)s (?:setup|call|teardown) +(?P<test>\S+::\S+)")


def gpu_test_files(root):
    """The test files under `root` that mark tests `gpu` (`pytestmark` or a decorator), relative to `root`'s parent."""
    return sorted(str(p.relative_to(root.parent)) for p in root.rglob("test_*.py")
                  if _MARKED.search(p.read_text(encoding="utf-8")))


def pytest_installed():
    """Whether pytest can be imported here (`pip install .` does not bring it)."""
    return importlib.util.find_spec("pytest") is not None


def not_run(why, command=None):
    """The result of a tests section that did not run, saying why."""
    return {"command": command, "summary": f"not run: {why}", "returncode": None, "tail": "", "log": None,
            "outcomes": [], "running": None}


def run_tests(seconds, out, root=None):
    """`pytest -m gpu` on the files under `root` that hold such tests, in a subprocess, for at most `seconds`:
    `{"command", "summary", "returncode" (None: not run, stopped), "tail", "log", "outcomes", "running"}`."""
    if not pytest_installed():
        return not_run('pytest is not installed: `pip install ".[gpu]"` (or ".[test]") brings it')
    clone = Path(kmix.__file__).resolve().parents[1] / "tests"  # the tests of the clone kmix runs from
    root = Path(root) if root else next((r for r in (clone, Path.cwd() / "tests") if r.is_dir()), None)
    if root is None:
        return not_run("no tests folder (run from a clone of kmix)")
    files = gpu_test_files(root)
    command = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *files]
    if not files:
        return not_run(f"no test file under {root} marks a test gpu", command)
    if seconds < MIN_SECONDS:
        return not_run(f"{max(0.0, seconds):.0f} s left in the budget", command)
    log = Path(out) / "pytest.log"
    env = {**os.environ, "TF_FORCE_GPU_ALLOW_GROWTH": "true", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root.parent), os.environ.get("PYTHONPATH")]))}
    returncode, stopped = None, False
    with open(log, "w", encoding="utf-8") as f, _terminate_as_exit():
        process = subprocess.Popen(command, cwd=root.parent, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            returncode = process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            stopped = True
        finally:  # a timeout, an interrupt or a SIGTERM of this command: the tests stop with it
            if process.poll() is None:
                process.kill()
                process.wait()
    output = log.read_text(encoding="utf-8", errors="replace")
    summary = f"stopped after {seconds:.0f} s (the budget)" if stopped else pytest_summary(output)
    return {"command": command, "summary": summary or "no summary line", "returncode": returncode,
            "tail": "\n".join(output.strip().splitlines()[-15:]), "log": str(log), "outcomes": outcomes(output),
            "running": running_test(output) if stopped else None}


@contextlib.contextmanager
def _terminate_as_exit():
    """Inside the block, SIGTERM raises `SystemExit`, so that `finally` blocks run (main thread only)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum)) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


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


def outcomes(output):
    """`[(test, outcome, seconds)]` from a verbose pytest log; seconds from `--durations` (None without)."""
    seconds = collections.defaultdict(float)
    for m in filter(None, map(_DURATION.match, output.splitlines())):
        seconds[m["test"]] += float(m["seconds"])
    return [(m["test"], m["outcome"], seconds.get(m["test"])) for m in map(_OUTCOME.match, output.splitlines()) if m]


def running_test(output):
    """The test a verbose pytest log shows started and not finished (where a run was stopped), or None."""
    for line in reversed(output.rstrip().splitlines()):
        if _OUTCOME.match(line):
            return None
        match = _STARTED.match(line + " ")
        if match:
            return match["test"]
    return None

