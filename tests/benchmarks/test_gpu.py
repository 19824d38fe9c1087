"""`python -m kmix bench gpu`: on a CPU-only machine it says so and exits 0; forced, it writes its report."""

import math

import keras
import pytest
import tensorflow as tf

from kmix import __main__ as cli
from kmix.benchmarks import gpu

pytestmark = pytest.mark.skipif(bool(tf.config.list_physical_devices("GPU")),
                                reason="these check the CPU-only behaviour; on a GPU: test_on_gpu.py")


def test_without_a_gpu_it_says_so_and_exits_0(capsys, tmp_path):
    assert cli.main(["bench", "gpu", "--out", str(tmp_path / "gpu")]) == 0
    assert capsys.readouterr().out.strip() == gpu.NO_GPU
    assert not (tmp_path / "gpu").exists()  # nothing measured, nothing written


def test_forced_tiny_run_writes_the_table_and_the_png(tmp_path, capsys):
    out = gpu.main(["--allow-cpu", "--quick", "--sections", "routes", "--routes", "float32", "--out", str(tmp_path)])
    keras.config.set_dtype_policy("float32")
    text = capsys.readouterr().out
    [row] = out["routes"]
    assert row["label"] == "float32" and row["jit_compile"] and row["step_seconds"] > 0
    assert math.isfinite(row["loss"])
    report = (tmp_path / "report.md").read_text()
    assert report in text and out["report"] == str(tmp_path / "report.md")
    header = "| " + " | ".join(gpu.ROUTE_HEADERS) + " |"
    lines = report.splitlines()
    cells = lines[lines.index(header) + 2].strip("| ").split(" | ")
    assert cells[:3] == ["float32", "keras", "on"] and cells[7] == "1"  # the baseline of the ratios
    assert float(cells[3]) == pytest.approx(row["step_seconds"] * 1e3, rel=1e-3)
    assert "### Memory" in report and "not run" in report  # the sections left out say so
    with open(out["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_report_writer_from_given_results(tmp_path):
    def route(label, seconds, peak):
        return {"label": label, "stack": "keras", "tf32": True, "policy": "float32" if "32" in label else "O1",
                "step_seconds": seconds, "tokens_per_second": 100 / seconds, "tflops": 1.0, "peak_bytes": peak,
                "loss": 2.0}

    def mem(name, peak):
        return {"name": name, "peak_bytes": peak, "state_bytes": peak // 2, "report_state_bytes": peak // 2,
                "step_seconds": 0.1, "loss": 1.0}

    routes = [route("float32", 0.2, 2**30), route("O1 float16", 0.1, 2**29), route("float32", 0.3, 2**30)]
    routes[2].update(label="float32 TF32 off", tf32=False)
    tests = {"command": ["python", "-m", "pytest", "-q", "-m", "gpu"], "summary": "7 passed in 30.1s",
             "returncode": 0, "tail": ""}
    size = dict(layers=1, d_model=8, heads=2, seq=4, vocab=8, batch=2, steps=1, rounds=1)
    report, png = gpu.write_report(tmp_path, "a GPU", routes, size, [mem("float32", 4 * 2**20), mem("O1", 2**21)],
                                   size, None, tests, ["demo: the demo (budget)"], 12.0)
    text = open(report).read()
    assert "| O1 float16 | keras | on | 100 | 1000 | 1 | 512.0 MiB | 2 | 0.5 | 2 | 3 |" in text
    assert "| O1 | 2.00 MiB | 1.00 MiB | 1.00 MiB | 100 | 0.5 | 1 | 1 |" in text
    assert "`pytest -q -m gpu`: 7 passed in 30.1s" in text and "- demo: the demo (budget)" in text
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_pytest_summary_and_the_budget():
    assert gpu.pytest_summary("....\n3 passed, 1 skipped in 12.34s\n") == "3 passed, 1 skipped in 12.34s"
    assert gpu.pytest_summary("= 2 failed, 5 passed in 70.00s (0:01:10) =") == "2 failed, 5 passed in 70.00s (0:01:10)"
    assert gpu.pytest_summary("no tests ran in 0.01s") == "no tests ran in 0.01s"
    budget = gpu.Budget(100.0)
    assert budget.allows("routes", "a", 1.0) and not budget.allows("routes", "b", 60.0)
    assert len(budget.skipped) == 1 and budget.skipped[0].startswith("routes: b (about 60 s expected")


def test_the_gpu_tests_are_found_by_their_mark():
    from pathlib import Path

    files = gpu.gpu_test_files(Path(__file__).resolve().parents[1])
    assert "tests/test_on_gpu.py" in files and "tests/benchmarks/test_gpu.py" not in files


def test_pytest_m_gpu_runs_in_a_subprocess_and_its_summary_is_read():
    """The tests section as a GPU machine runs it; here every gpu test is skipped, saying so."""
    tests = gpu.run_tests(gpu.Budget(600.0))
    assert tests["command"][1:5] == ["-m", "pytest", "-q", "-m"] and "tests/test_on_gpu.py" in tests["command"]
    assert tests["returncode"] == 0, tests["tail"]
    skipped = int(tests["summary"].split(" skipped")[0])
    assert skipped >= 10 and "passed" not in tests["summary"] and " in " in tests["summary"]
