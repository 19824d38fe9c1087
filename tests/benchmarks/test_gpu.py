"""`python -m kmix bench gpu` on a CPU: why it does not run, and, forced (`--allow-cpu`), all it does.

The checks of tests/test_on_gpu.py run here too, small and on the CPU, so that they cannot rot
before a GPU comes; what only a GPU can show (TF32, tensor cores) stays there.
"""

import math
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from kmix import __main__ as cli
from kmix import _startup
from kmix.benchmarks import gpu, gpu_check, gpu_routes, gpu_tests
from kmix.benchmarks.gpu_report import ROUTE_HEADERS, Report
from kmix.route import probe as probe_module
from kmix.route import timing, trials
from tests import test_on_gpu as on_gpu

pytestmark = pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")),
                                reason="these check the CPU-only behaviour; on a GPU: test_on_gpu.py")

DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024"
TINY = {"layers": 1, "d_model": 16, "heads": 2, "seq": 16, "vocab": 64, "batch": 4}
SMALL = {**TINY, "d_model": 32}


def _cells(report, header, row):
    """The cells of the table row `row` (0-based) under `header` in a markdown report."""
    lines = report.splitlines()
    return lines[lines.index("| " + " | ".join(header) + " |") + 2 + row].strip("| ").split(" | ")


# ---------------------------------------------------------------- 1. no GPU: say so, and why


def test_without_a_gpu_or_a_driver_it_says_so_and_exits_0(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "nvidia_driver", lambda: None)
    assert cli.main(["bench", "gpu", "--out", str(tmp_path / "gpu")]) == 0
    assert capsys.readouterr().out.strip() == gpu.NO_GPU
    assert not (tmp_path / "gpu").exists()  # nothing measured, nothing written


@pytest.fixture(scope="module")
def tensorflow_log():
    """What this machine's TensorFlow logs while it looks for GPUs (a fresh process, every level on)."""
    return gpu_check.tensorflow_gpu_log()


def test_with_a_driver_and_no_gpu_it_prints_tensorflows_reason_and_exits_1(capsys, tmp_path, monkeypatch,
                                                                            tensorflow_log):
    monkeypatch.setattr(gpu_check, "nvidia_driver", lambda: DRIVER)
    monkeypatch.setattr(gpu_check, "tensorflow_gpu_log", lambda: tensorflow_log)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "gpu", "--out", str(tmp_path)])
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert DRIVER in out and "sees no GPU" in out and '`pip install ".[gpu]"`' in out
    build = tf.sysconfig.get_build_info()
    if build.get("is_cuda_build"):  # TensorFlow's own words: every line of its log that names CUDA
        cuda_lines = [line.strip() for line in tensorflow_log.splitlines() if "cuda" in line.lower() and "]" in line]
        assert cuda_lines and all(line in out for line in cuda_lines), (cuda_lines, out)
        assert f"CUDA {build['cuda_version']}" in out
    assert out.strip() in (tmp_path / "report.md").read_text()  # the message is the report


def test_the_startup_filter_keeps_the_cuda_lines_where_a_driver_is(tmp_path, monkeypatch):
    log = textwrap.dedent("""\
        I0000 00:00:1.0    1 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
        I0000 00:00:1.0    1 cpu_feature_guard.cc:227] This TensorFlow binary is optimized
        To enable the following instructions: AVX2 FMA, rebuild TensorFlow
        W0000 00:00:1.0    1 gpu_device.cc:2344] Cannot dlopen some GPU libraries. Please make sure
        E0000 00:00:1.0    1 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error
        E0000 00:00:1.0    1 op_kernel.cc:12] a real error
        """)
    lines = log.splitlines(keepends=True)
    assert _startup.drop_startup_notes(log) == lines[5]  # no driver: the CUDA probing is noise
    assert _startup.drop_startup_notes(log, keep_gpu_reasons=True) == "".join(lines[i] for i in (0, 3, 4, 5))
    version = tmp_path / "version"
    version.write_text(DRIVER + "\nGCC version: 12\n")
    assert _startup.nvidia_driver(str(version)) == " ".join(DRIVER.split())
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi there
    assert _startup.nvidia_driver(str(tmp_path / "missing")) is None
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    assert _startup.nvidia_driver(str(tmp_path / "missing")) == f"nvidia-smi at {tmp_path / 'nvidia-smi'}"


# ---------------------------------------------------------------- 2 and 4. the routes, each alone


def test_forced_tiny_run_prints_the_route_and_writes_the_columns(tmp_path, capsys):
    out = gpu.main(["--allow-cpu", "--quick", "--sections", "routes", "--routes", "float32", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    [row] = out["routes"]
    size = gpu.SIZES["quick"]["routes"]
    assert "error" not in row and row["jit_compile"] and len(row["rounds"]) == size["rounds"]
    assert size["min_steps"] <= row["steps"] <= size["max_steps"]
    assert row["step_seconds"] == pytest.approx(timing.median(row["rounds"]))
    assert row["steps_run"] == 4 + row["steps"] * size["rounds"] and math.isfinite(row["loss"])
    assert row["skipped"] == 0 and row["scale"] is None  # float32: no loss scaling, every step applied
    assert gpu.route_line(row) in text  # printed as measured
    report = (tmp_path / "report.md").read_text()
    assert report in text and out["report"] == str(tmp_path / "report.md") and "s in all" in report
    cells = _cells(report, ROUTE_HEADERS, 0)
    assert cells[:4] == ["float32", "keras", "yes", "on"] and cells[ROUTE_HEADERS.index("speed x f32")] == "1"
    assert float(cells[4]) == pytest.approx(row["step_seconds"] * 1e3, rel=1e-3)
    assert cells[5] == f"{timing.spread(row['rounds']):.1%}" and cells[14:16] == ["0", "-"]
    assert "### Memory" in report and "not run" in report  # the sections left out say so
    with open(out["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_float16_route_counts_its_skipped_steps_and_its_scale():
    """Keras's `mixed_float16` without XLA (a quick compile on a CPU): its scale halves once a skipped step."""
    size = gpu.SIZES["quick"]["routes"]
    row = gpu_routes.measure(("mixed_float16 no XLA", "mixed_float16", "keras", True, False), size)
    assert "error" not in row and row["jit_compile"] is False and math.isfinite(row["loss"])
    assert row["scale"] == 2.0**15 / 2**row["skipped"] and 0 <= row["skipped"] < row["steps_run"]
    assert gpu.route_rows([row])[0][ROUTE_HEADERS.index("final scale")] == f"{row['scale']:g}"
    assert gpu.route_line(row).startswith("route mixed_float16 no XLA (keras, no XLA, TF32 on): ")


def test_a_failing_route_is_a_row_and_the_next_one_runs(monkeypatch):
    previous = tf.config.experimental.tensor_float_32_execution_enabled()

    def out_of_memory(*args, **kwargs):
        keras.config.set_dtype_policy("mixed_float16")
        raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor\nmore")

    monkeypatch.setattr(gpu_routes, "Route", out_of_memory)
    row = gpu_routes.measure(("O2 float16", "O2-float16", "recommended", not previous, True), {})
    assert row["error"] == "ResourceExhaustedError: OOM when allocating tensor" and row["label"] == "O2 float16"
    assert tf.config.experimental.tensor_float_32_execution_enabled() == previous  # put back
    assert keras.config.dtype_policy().name == "float32"


def test_the_report_is_on_disk_after_every_item_and_a_kill_leaves_it(tmp_path, monkeypatch, capsys):
    """Each item alone: the report is rewritten after each; an interrupt leaves the ones measured."""
    seen = []

    def fake_measure(spec, size):
        seen.append((tmp_path / "report.md").read_text())  # what a kill now would leave
        if spec[0] == "O1 float16":
            raise KeyboardInterrupt  # the command killed while this route runs
        if spec[0] == "O1 bfloat16":
            return {"label": spec[0], "policy": spec[1], "stack": spec[2], "tf32": spec[3],
                    "jit_compile": spec[4], "error": "InternalError: a failed compile"}
        return {"label": spec[0], "policy": spec[1], "stack": spec[2], "tf32": spec[3], "jit_compile": spec[4],
                "step_seconds": 0.01, "rounds": (0.01, 0.01), "steps": 10, "spread": 0.0, "overhead": 0.02,
                "tokens_per_second": 100.0, "tflops": 1.0, "peak_bytes": 2**20, "loss_first": 4.0, "loss": 3.0,
                "steps_run": 24, "skipped": 0, "scale": None}

    monkeypatch.setattr(gpu_routes, "measure", fake_measure)
    report = Report(tmp_path, "a test", gpu.SIZES["quick"])
    with pytest.raises(KeyboardInterrupt):
        gpu.run_routes(gpu.SIZES["quick"]["routes"], gpu.Budget(100.0, ["routes"]), report)
    assert "still running" in seen[0] and "at: routes float32" in seen[0] and "| float32 |" not in seen[0]
    assert "| float32 | keras | yes | on | 10 |" in seen[1] and "at: routes O1 bfloat16" in seen[1]
    left = (tmp_path / "report.md").read_text()
    assert "| float32 | keras |" in left and "| O1 bfloat16 | kmix.autocast | yes | on | failed |" in left
    assert "- O1 bfloat16 failed: `InternalError: a failed compile`" in left and "at: routes O1 float16" in left
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("route float32 (keras, XLA, TF32 on): 10 ms/step")
    assert printed[1] == "route O1 bfloat16 (kmix.autocast, XLA, TF32 on): failed: InternalError: a failed compile"
    assert gpu.failed(report) == ["route O1 bfloat16"]


def test_the_routes_order_and_rounds():
    labels = [r[0] for r in gpu.ROUTES]
    second_bfloat16 = [i for i, r in enumerate(gpu.ROUTES) if "bfloat16" in r[1]][1]
    assert labels[0] == "float32" and all(labels.index(r[0]) < second_bfloat16 for r in gpu.ROUTES
                                          if r[1] in ("O1-float16", "mixed_float16"))
    assert ("kmix float32", "float32", "recommended", True, True) in gpu.ROUTES
    assert [r for r in gpu.ROUTES if not r[4]] and [r for r in gpu.ROUTES if not r[3]]  # no XLA; TF32 off
    assert gpu_routes.steps_per_round(0.01, 1.0, 5, 400) == 100 and gpu_routes.steps_per_round(2.0, 1.0, 5, 400) == 5
    # a round of 100 steps of 9 ms behind a 40 ms fixed cost; a one-step fit: 40 + 9 ms
    assert gpu_routes.fit_overhead(0.049, 0.94, 100) == pytest.approx(0.04 / 0.94)


def test_the_report_writer_from_given_results(tmp_path):
    def route(label, seconds, peak, policy="float32", tf32=True, **extra):
        return {"label": label, "stack": "keras", "tf32": tf32, "policy": policy, "jit_compile": True,
                "step_seconds": seconds, "rounds": (seconds,) * 3, "steps": 50, "spread": 0.012, "overhead": 0.03,
                "tokens_per_second": 100 / seconds, "tflops": 1.0, "peak_bytes": peak, "loss_first": 4.0,
                "loss": 2.0, "steps_run": 154, "skipped": 0, "scale": None, **extra}

    report = Report(tmp_path, "a GPU", {"routes": dict(TINY, rounds=3, round_s=1.0), "memory": dict(TINY, steps=1)})
    report.routes = [route("float32", 0.2, 2**30), route("O1 float16", 0.1, 2**29, "O1-float16", skipped=2,
                                                         scale=8192.0),
                     route("float32 TF32 off", 0.3, 2**30, tf32=False)]
    report.memory = [{"name": "float32", "peak_bytes": 4 * 2**20, "state_bytes": 2**21, "report_state_bytes": 2**21,
                      "step_seconds": 0.1, "loss": 1.0},
                     {"name": "O1", "peak_bytes": 2**21, "state_bytes": 2**20, "report_state_bytes": 2**20,
                      "step_seconds": 0.1, "loss": 1.0}, {"name": "O2 kahan", "error": "ValueError: no"}]
    report.tests = {"command": [sys.executable, "-m", "pytest", "-v", "-m", "gpu"], "summary": "1 failed in 30.1s",
                    "returncode": 1, "tail": "E   assert 1 == 2", "log": "pytest.log", "running": None,
                    "outcomes": [("tests/test_on_gpu.py::test_a", "FAILED", 30.0)]}
    report.skipped, report.seconds = ["memory: memory O2 masters (budget)"], 12.0
    png = report.save(plot=True)
    text = open(report.path).read()
    # 0.1 s a step: 100 ms, 1000 tokens/s, half float32's time (2x), half its peak (0.5x), 3x TF32 off's speed
    assert ("| O1 float16 | keras | yes | on | 100 | 1.2% | 3.0% | 50 | 1000 | 1 | 512.0 MiB | 2 | 0.5 | 2 | 2 | 8192 "
            "| 3 |") in text
    assert "| O1 | 2.00 MiB | 1.00 MiB | 1.00 MiB | 100 | 0.5 | 1 | 1 |" in text
    assert "- O2 kahan failed: `ValueError: no`" in text and "`pytest -v -m gpu`: 1 failed in 30.1s" in text
    assert "| tests/test_on_gpu.py::test_a | FAILED | 30.0 |" in text
    assert "E   assert 1 == 2" in text and "- memory: memory O2 masters (budget)" in text and "12 s in all" in text
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert gpu.failed(report) == ["pytest -m gpu: 1 failed in 30.1s", "memory O2 kahan"]


# ---------------------------------------------------------------- 3. the tests, first, verbose


def test_the_budget_gives_each_section_its_share():
    budget = gpu.Budget(100.0, ["memory", "tests"])  # in SECTIONS' order whatever the order given
    assert list(budget.deadlines) == ["tests", "memory"]
    share = gpu.SHARES["tests"] / (gpu.SHARES["tests"] + gpu.SHARES["memory"])
    assert budget.left("tests") == pytest.approx(100.0 * share, abs=0.5) and budget.left("memory") <= 100.0
    assert budget.allows("tests", "a", 1.0) and not budget.allows("tests", "b", 99.0)
    assert len(budget.skipped) == 1 and budget.skipped[0].startswith("tests: b (about 99 s expected")


def test_pytest_output_is_read():
    log = textwrap.dedent("""\
        tests/test_on_gpu.py::test_a[True] PASSED                                [ 33%]
        tests/test_on_gpu.py::test_b SKIPPED (needs a GPU)                       [ 66%]
        ============================= slowest durations ==============================
        2.50s call     tests/test_on_gpu.py::test_a[True]
        0.50s setup    tests/test_on_gpu.py::test_a[True]
        =========================== short test summary info ==========================
        PASSED tests/test_on_gpu.py::test_a[True]
        = 1 passed, 1 skipped in 70.00s (0:01:10) =
        """)
    assert gpu_tests.pytest_summary(log) == "1 passed, 1 skipped in 70.00s (0:01:10)"
    assert gpu_tests.pytest_summary("no tests ran in 0.01s") == "no tests ran in 0.01s"
    assert gpu_tests.outcomes(log) == [("tests/test_on_gpu.py::test_a[True]", "PASSED", 3.0),
                                       ("tests/test_on_gpu.py::test_b", "SKIPPED", None)]
    assert gpu_tests.running_test(log) is None
    assert gpu_tests.running_test(log.splitlines()[0] + "\ntests/test_on_gpu.py::test_c[x] ") == \
        "tests/test_on_gpu.py::test_c[x]"


def test_the_gpu_tests_are_found_by_their_mark():
    from pathlib import Path

    files = gpu_tests.gpu_test_files(Path(__file__).resolve().parents[1])
    assert "tests/test_on_gpu.py" in files and "tests/benchmarks/test_gpu.py" not in files


def test_pytest_m_gpu_runs_verbose_in_a_subprocess_and_is_read(tmp_path):
    """The tests section as a GPU machine runs it; here every gpu test is skipped, each named."""
    tests = gpu_tests.run_tests(600.0, tmp_path)
    assert tests["command"][1:3] == ["-m", "pytest"] and "-v" in tests["command"] and "-rA" in tests["command"]
    assert "--durations=0" in tests["command"] and "tests/test_on_gpu.py" in tests["command"]
    assert tests["returncode"] == 0, tests["tail"]
    skipped = int(tests["summary"].split(" skipped")[0])
    names = {t for t, outcome, _ in tests["outcomes"] if outcome == "SKIPPED"}
    assert skipped == len(tests["outcomes"]) == len(names) >= 15 and "passed" not in tests["summary"]
    assert "tests/test_on_gpu.py::test_demo_on_the_gpu" in names
    assert open(tests["log"]).read().count("SKIPPED") >= skipped


def test_a_stopped_test_run_names_the_test_it_stopped_in(tmp_path, monkeypatch):
    root = tmp_path / "tests"
    root.mkdir()
    (root / "test_slow.py").write_text(textwrap.dedent("""\
        import time
        import pytest

        pytestmark = pytest.mark.gpu

        def test_fast():
            pass

        def test_slow():
            time.sleep(120)
        """))
    monkeypatch.setattr(gpu_tests, "MIN_SECONDS", 0)
    began = time.perf_counter()
    tests = gpu_tests.run_tests(10.0, tmp_path, root)
    assert time.perf_counter() - began < 40  # stopped, not waited for
    assert tests["running"] == "tests/test_slow.py::test_slow" and tests["returncode"] is None
    assert tests["outcomes"][0][:2] == ("tests/test_slow.py::test_fast", "PASSED")
    assert tests["summary"].startswith("stopped after 10 s")


def test_without_pytest_the_tests_section_says_so_and_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_tests, "pytest_installed", lambda: False)
    tests = gpu_tests.run_tests(600.0, tmp_path)
    assert tests["summary"].startswith("not run: pytest is not installed") and '".[gpu]"' in tests["summary"]
    report = Report(tmp_path, "a test", gpu.SIZES["quick"])
    report.tests = tests
    assert gpu.failed(report) == [f"pytest -m gpu: {tests['summary']}"]


# ---------------------------------------------------------------- 5. the GPU checks, small, on the CPU


HALF_ROUTE = dict(policy="O1-bfloat16", stack="recommended", size=SMALL, steps=8, learning_rate=3e-3, device="CPU:0",
                  jit_compile=False)  # the half route checked, as check_half_route_trains_like_float32 trains it


@pytest.fixture(scope="module")
def cpu_float32_losses():
    """Float32's losses over 8 steps of a tiny GPT on the CPU: the reference of the half route checked."""
    return on_gpu.train_route("float32", "keras", SMALL, steps=8, learning_rate=3e-3, device="CPU:0",
                              jit_compile=False)[1]


@pytest.fixture(scope="module")
def cpu_half_route():
    """`on_gpu.train_route` of the half route checked, trained once: `(route, losses)`."""
    return on_gpu.train_route(*HALF_ROUTE.values())


def _trained(monkeypatch, result):
    """`on_gpu.train_route` answering `result` where asked for the half route (trained once, by the fixture)."""
    def train_route(*args, **kwargs):
        assert dict(zip(HALF_ROUTE, args), **kwargs) == HALF_ROUTE, (args, kwargs)
        return result

    monkeypatch.setattr(on_gpu, "train_route", train_route)


def _check_half_route(cpu_float32_losses):
    kwargs = {k: v for k, v in HALF_ROUTE.items() if k not in ("policy", "stack")}
    on_gpu.check_half_route_trains_like_float32(HALF_ROUTE["policy"], cpu_float32_losses, **kwargs)


def test_the_gpu_checks_hold_on_the_cpu(cpu_float32_losses, cpu_half_route, monkeypatch):
    """tests/test_on_gpu.py's checks on the CPU: fused Adam, MirroredStrategy + XLA, a half route."""
    for jit_compile in (False, True):
        on_gpu.check_fused_adam_matches_keras(jit_compile, device="CPU:0")
    on_gpu.check_mirrored_xla_matches_one_device(device="CPU:0")
    assert on_gpu.check_tf32_error(False, True, device="CPU:0") < 1e-5  # float32 on a CPU: no TF32
    _trained(monkeypatch, cpu_half_route)
    _check_half_route(cpu_float32_losses)


def test_a_half_route_that_does_not_learn_fails_the_check(monkeypatch, cpu_float32_losses, cpu_half_route):
    """A route whose half steps change nothing (its loss stays at the untrained model's) fails the loss-drop check."""
    route, losses = cpu_half_route
    flat = [losses[0]] * len(losses)  # what a learning rate of 0 trains: the same batch, the same weights
    _trained(monkeypatch, (route, flat))
    with pytest.raises(AssertionError) as failed:
        _check_half_route(cpu_float32_losses)
    assert "Obtained: 0.0" in str(failed.value)  # the loss-drop assertion: a drop of 0 against float32's


# ---------------------------------------------------------------- 6. recommend's and the probe's timings


def test_the_build_estimate_times_the_forward_pass_to_its_end():
    """The estimate waits for the outputs (a dict, a list inside): here one is ready 0.2 s after the call."""
    def slow(x):
        return tf.py_function(lambda t: (time.sleep(0.2), t)[1], [x], x.dtype)

    inputs = keras.Input((4,))
    model = keras.Model(inputs, {"a": keras.layers.Lambda(slow, output_shape=(4,))(inputs), "b": [inputs * 2]})
    build, forward = trials.build_estimate(model, np.ones((2, 4), "float32"))
    assert forward >= 0.2 and build == pytest.approx(forward * trials.BUILD_FORWARDS)


def test_the_probe_rows_grow_until_a_call_is_not_launch_bound():
    calls = []

    def launch_bound(rows):  # 0.1 ms of launches, then 1e-7 s a row
        calls.append(rows)
        return 1e-4 + rows * 1e-7

    # 1e-4 + 16384e-7 = 1.74 ms < 2 ms; 1e-4 + 32768e-7 = 3.38 ms
    assert probe_module.size_rows(launch_bound, 1024, 65536, 2e-3) == 32768
    assert calls == [1024, 2048, 4096, 8192, 16384, 32768]
    assert probe_module.size_rows(launch_bound, 1024, 20000, 2e-3) == 20000  # the limit
    assert probe_module.size_rows(lambda rows: 1.0, 8192, 16384, 2e-3) == 8192  # long enough already
    assert probe_module.gpu_row_limit((8192, 4096, 4096)) == 2**28 // (4 * 4096)
    assert probe_module.gpu_row_limit((2**20, 4096, 4096)) == 2**20  # never fewer rows than asked


def test_the_probe_is_cached_per_tf32_setting():
    """One probe per TF32 setting; `limit_s=0` leaves XLA out (not what is checked here: 3 compiles a probe)."""
    previous = tf.config.experimental.tensor_float_32_execution_enabled()
    shape = (64, 16, 32)
    try:
        first = probe_module.probe(shape, budget=0.001, limit_s=0.0)
        assert first.compilations == (False,) and first.tf32 == previous
        assert probe_module.probe(shape, budget=0.001, limit_s=0.0) is first
        tf.config.experimental.enable_tensor_float_32_execution(not previous)
        other = probe_module.probe(shape, budget=0.001, limit_s=0.0)
        assert other is not first and other.tf32 == (not previous) and other.rows == first.rows
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(previous)
