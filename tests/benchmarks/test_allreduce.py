"""`python -m kmix bench allreduce --quick`: two workers, the table, and its byte counts checked by hand."""

from kmix.benchmarks import allreduce


def test_quick_run_prints_the_table_with_half_the_bytes(capsys):
    rows = allreduce.main(["--quick"])
    text = capsys.readouterr().out
    assert [r[0] for r in rows] == ["float32", "float16", "bfloat16"]
    # --quick: two Dense(64) layers, 2 * (64 * 64 + 64) gradients in 4 variables; float32 4 bytes
    # each, the half dtypes 2, and float16 one float32 wire-scale bound per variable besides.
    size = 2 * (64 * 64 + 64)
    expected = {"float32": size * 4, "float16": size * 2 + 4 * 4, "bfloat16": size * 2}
    for name, step_ms, skipped, megabytes, step_ratio, byte_ratio in rows:
        assert step_ms > 0 and step_ratio == step_ms / rows[0][1]
        assert megabytes == expected[name] / 1e6
        assert byte_ratio == expected[name] / expected["float32"]
        assert skipped == 0  # the float16 sums keep their range: no step lost to the wire
    assert "step / float32" in text and "skipped" in text and "8,320 parameters" in text
