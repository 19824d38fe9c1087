"""`python -m kmix bench memory --quick`: the table, the PNG, and its figures checked another way."""

import keras
import numpy as np
import pytest

from kmix.benchmarks import memory
from tests.testing import full_only


@full_only("bench memory's quick run: 140 s on 2 cores, eight configurations each traced")
@pytest.mark.xfail(reason="after merging issues 38-41 (2026-11-26) the O2 kahan row's measured state is 0.79 MB "
                   "below float32 masters' against memory_report's 1.16 MB: to be found (issue 40 follow-up)",
                   strict=False)
def test_quick_run_prints_the_table_and_its_figures_add_up(tmp_path, capsys):
    path = str(tmp_path / "memory.png")
    out = memory.main(["--quick", "--plot", path])
    text = capsys.readouterr().out
    names = [c[0] for c in memory.CONFIGS]
    assert [r["name"] for r in out["results"]] == names
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["configuration"])
    assert [line.rsplit("MiB", 3)[0].strip().rsplit(" ", 1)[0].strip() for line in lines[header + 2: header + 2 + len(names)]] == names
    by_name = {r["name"]: r for r in out["results"]}
    for r in out["results"]:
        assert r["peak_bytes"] >= r["state_bytes"] > 0 and r["step_seconds"] > 0 and np.isfinite(r["loss"])
        # What stays allocated between steps is what memory_report predicts, counted
        # from the variables' shapes: the allocator rounds, and on a CPU it does not see
        # tensors under 256 KiB (biases, norms), hence the tolerance.
        if "accum" in r["name"]:  # the accumulators and what the micro-batch loop keeps alive
            assert r["state_bytes"] >= 0.8 * r["report_state_bytes"], r
        else:
            assert r["state_bytes"] == pytest.approx(r["report_state_bytes"], rel=0.2), r
    # Kahan buffers (2 bytes, and bfloat16 slots) against float32 masters (4 bytes, float32 slots):
    saved = by_name["O2 masters"]["state_bytes"] - by_name["O2 kahan"]["state_bytes"]
    predicted = by_name["O2 masters"]["report_state_bytes"] - by_name["O2 kahan"]["report_state_bytes"]
    assert saved == pytest.approx(predicted, rel=0.25)
    # The ratio columns are the figures divided by float32's.
    base = by_name["float32"]
    for row, r in zip(out["rows"], out["results"]):
        assert row[5] == pytest.approx(r["peak_bytes"] / base["peak_bytes"])
        assert row[6] == pytest.approx(r["step_seconds"] / base["step_seconds"])
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    keras.config.set_dtype_policy("float32")


def test_bad_arguments():
    with pytest.raises(SystemExit):
        memory.main(["--batch", "3", "--no-plot"])


def test_an_allocator_without_statistics_gets_a_clear_error(monkeypatch):
    def no_statistics(device):
        raise ValueError(f"Allocator stats not available for device '{device}'")

    monkeypatch.setattr(memory.tf.config.experimental, "get_memory_info", no_statistics)
    size = {"layers": 1, "d_model": 8, "heads": 2, "seq": 4, "batch": 2, "vocab": 16}
    with pytest.raises(RuntimeError, match="keeps no statistics .*TF_CPU_ALLOCATOR_USE_BFC=true"):
        memory.measure(memory.CONFIGS[0], size, steps=1, jit_compile=False)


def test_the_cpu_allocator_is_one_that_keeps_statistics():
    # tests/conftest.py turns oneDNN on; its allocator keeps statistics, so nothing is changed.
    assert memory.use_a_cpu_allocator_with_statistics().startswith("oneDNN")
    assert "current" in memory.tf.config.experimental.get_memory_info("CPU:0")
