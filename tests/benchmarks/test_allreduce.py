"""`python -m kmix bench allreduce --quick`: two workers, the table, and its byte counts checked by hand."""

from kmix.benchmarks import allreduce


def test_quick_run_prints_the_table_with_half_the_bytes(capsys):
    rows = allreduce.main(["--quick"])
    text = capsys.readouterr().out
    assert [r[0] for r in rows] == ["float32", "float16", "bfloat16"]
    # --quick: two Dense(64) layers, 2 * (64 * 64 + 64) float32 gradients, 4 bytes each.
    assert rows[0][2] == 2 * (64 * 64 + 64) * 4 / 1e6
    for name, step_ms, megabytes, step_ratio, byte_ratio in rows:
        assert step_ms > 0 and step_ratio == step_ms / rows[0][1]
        assert byte_ratio == (1.0 if name == "float32" else 0.5)
    assert "step / float32" in text and "8,320 parameters" in text
