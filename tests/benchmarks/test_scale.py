"""`python -m kmix bench scale`: its measurements on a tiny GPT-2, in this process and in a fresh one."""

import pytest

from kmix.benchmarks import scale

pytest.importorskip("keras_hub")


def test_in_process_calls_on_a_tiny_gpt2_measure_time_and_memory_against_the_build():
    results = scale.run(["tiny"], calls=["build", "autocast"], seq=8, fresh=False, verbose=False)
    assert [r["call"] for r in results] == ["build", "autocast"]
    for r in results:
        assert r["seconds"] > 0 and r["build_s"] > 0 and r["extra_bytes"] >= 0
        # The float32 weights, counted from the variables: the classifier's parameters, 4 bytes each.
        assert r["weight_bytes"] == 4 * r["parameters"]
    table = scale.rows(results + [{"model": "tiny", "call": "recommend", "error": "MemoryError"}])
    assert [row[1] for row in table] == ["build", "autocast", "recommend"]
    assert table[0][4] == "1.00" and table[1][2] == "kmix" and table[-1][3:5] == ["failed", "MemoryError"]
    x_build = float(table[1][4])
    assert x_build == pytest.approx(results[1]["seconds"] / results[1]["build_s"], abs=0.01)


def test_a_call_in_a_fresh_process_reports_back():
    (result,) = scale.run(["tiny"], calls=["build"], seq=8, verbose=False)
    assert "error" not in result, result
    assert result["call"] == "build" and result["seconds"] == result["build_s"] > 0


def test_the_cli_registers_bench_scale():
    from kmix.__main__ import BENCHES

    assert BENCHES["scale"] == "kmix.benchmarks.scale"
    assert set(scale.DEFAULT_MODELS) | set(scale.LARGE_MODELS) <= set(scale.MODELS)
