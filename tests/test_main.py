"""`python -m kmix`: each command reaches its own parser."""

import pytest

from kmix.__main__ import main


@pytest.mark.parametrize("argv, words", [
    (["bench", "overhead", "--help"], ["--layers", "--rounds"]),
    (["bench", "softmax", "--help"], ["--quick"]),
    (["demo", "--help"], ["--steps", "--policy", "--out"]),
    (["bench", "--help"], ["overhead", "softmax", "train"]),
])
def test_help_reaches_the_command(capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    assert info.value.code == 0
    out = capsys.readouterr().out
    for word in words:
        assert word in out


def test_overhead_bench_prints_ratio_rows(capsys):
    rows = main(["bench", "overhead", "--layers", "2", "--steps", "3", "--rounds", "1", "--no-jit"])
    out = capsys.readouterr().out
    assert "kmix / keras" in out and "tf.function" in out
    assert rows == 0
