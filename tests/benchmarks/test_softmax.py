"""`kmix.benchmarks.softmax --quick`: the printed table meets the float32 error target."""

from kmix.benchmarks import softmax


def test_quick_run_prints_the_error_table(capsys):
    rows = softmax.main(["--quick"])
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["T", "mode"])
    columns = [c.strip() for c in lines[header].split("  ") if c.strip()]
    assert columns == softmax.HEADERS
    table = [line.split() for line in lines[header + 2:] if line.strip()]
    assert len(table) == len(rows) == 4  # two lengths, eager and XLA
    assert {r[1] for r in table} == {"eager", "XLA"}
    kmix_err = [float(r[columns.index("kmix err f32")]) for r in table]
    keras_err = [float(r[columns.index("keras err")]) for r in table]
    # Errors against a float64 softmax: kmix's float32 output meets the target,
    # Keras's float16 softmax does not.
    assert max(kmix_err) <= 1e-6, kmix_err
    assert min(keras_err) > 1e-5, keras_err
    assert all(float(r[-1]) > 0 for r in table)
