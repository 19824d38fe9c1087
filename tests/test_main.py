"""`python -m kmix`: each command reaches its own parser."""

import keras
import pytest

from kmix.__main__ import main
from kmix.benchmarks import overhead


@pytest.mark.parametrize("argv, words", [
    (["bench", "overhead", "--help"], ["--layers", "--rounds"]),
    (["bench", "softmax", "--help"], ["--quick"]),
    (["demo", "--help"], ["--steps", "--policy", "--out"]),
    (["bench", "memory", "--help"], ["--quick", "--jit", "256 KiB"]),
    (["bench", "--help"], ["memory", "overhead", "softmax", "train"]),
])
def test_help_reaches_the_command(capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        main(argv)
        raise SystemExit(0)
    assert info.value.code == 0
    out = capsys.readouterr().out
    for word in words:
        assert word in out


def test_overhead_bench_times_the_same_training(capsys):
    previous = keras.config.dtype_policy().name
    rows = overhead.main(["--layers", "2", "--steps", "3", "--rounds", "2"])
    assert keras.config.dtype_policy().name == previous  # the benchmark restored the policy
    assert "kmix / keras" in capsys.readouterr().out
    *steps, apply_row = rows
    assert [row[0] for row in steps] == ["tf.function", "XLA"]
    for label, keras_ms, kmix_ms, ratio, _, same in steps:
        assert keras_ms > 0 and kmix_ms > 0
        assert ratio == pytest.approx(kmix_ms / keras_ms)
        # Both optimizers took the same steps: kmix with Keras's defaults is Keras, bit for bit.
        assert same == "yes", label
    assert apply_row[0] == "apply only" and apply_row[3] == pytest.approx(apply_row[2] / apply_row[1])
