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
    """The smallest run that still times both compilations and `apply` alone: one layer, one round of two steps."""
    previous = keras.config.dtype_policy().name
    rows = overhead.main(["--layers", "1", "--steps", "2", "--rounds", "1"])
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


def run_python(args, **env):
    """`python ARGS` in a fresh process, from the repository, TF_CPP_MIN_LOG_LEVEL unset unless given."""
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    environ.update(env)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, *args], cwd=root, env=environ, capture_output=True, text=True,
                          timeout=120)


TF_NOTES = ("oneDNN custom operations", "cuda drivers", "cuInit", "absl::InitializeLog", "cpu_feature_guard")

# Each test below starts TensorFlow in a fresh process (5-8 s of CPU) and makes two checks of it.
AS_COMMAND = ("import sys; sys.orig_argv = [sys.executable, '-m', 'kmix', 'bench']  # as `python -m kmix bench`\n"
              "import kmix, tensorflow as tf\n"
              "tf.get_logger().warning('a warning after the start')\n"
              "from kmix.__main__ import main\n"
              "sys.exit(main(['bench']))")


def test_command_starts_tensorflow_quietly_and_its_warnings_print_without_a_logging_error():
    """Without the user's TF_CPP_MIN_LOG_LEVEL, a command's terminal holds kmix's output only; TensorFlow's
    logger, made while the start was quiet, writes to stderr afterwards (no closed stream).

    Run as `python -c` with `sys.orig_argv` set as `python -m kmix bench` sets it (what `launched_as_command`
    reads; checked on that argv below), so that a warning can be logged after the start;
    test_command_keeps_the_users_log_level runs `python -m kmix bench` itself.
    """
    done = run_python(["-c", AS_COMMAND])
    assert done.returncode == 2, done.stderr  # `bench` without a name prints its usage
    assert "memory" in done.stdout and "overhead" in done.stdout
    assert not [note for note in TF_NOTES if note in done.stderr], done.stderr
    assert "Logging error" not in done.stderr and "closed file" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()  # the warning ("WARNING:tensorflow:a warning ..."), and nothing else
    assert len(lines) == 1 and lines[0].endswith("a warning after the start"), done.stderr


def test_command_keeps_the_users_log_level():
    """`python -m kmix bench` itself: a user who set TF_CPP_MIN_LOG_LEVEL=0 sees TensorFlow's notes, as they
    asked, and the command's usage with its exit status."""
    done = run_python(["-m", "kmix", "bench"], TF_CPP_MIN_LOG_LEVEL="0")
    assert "oneDNN custom operations" in done.stderr or "cuda" in done.stderr
    assert done.returncode == 2, done.stderr  # `bench` without a name prints its usage
    assert "memory" in done.stdout and "overhead" in done.stdout


def test_drop_startup_notes_keeps_errors_and_other_text():
    from kmix._startup import drop_startup_notes, launched_as_command

    text = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1795458843.879245    5228 cpu_feature_guard.cc:227] This TensorFlow binary\n"
        "To enable the following instructions: AVX2, rebuild TensorFlow\n"
        "E0000 00:00:1795458846.663906    5228 cuda_platform.cc:52] failed call to cuInit: UNKNOWN\n"
        "E0000 00:00:1795458846.663906    5228 op_kernel.cc:12] a real error\n"
        "  its second line\n"
    )
    assert drop_startup_notes("plain\n" + text) == (
        "plain\nE0000 00:00:1795458846.663906    5228 op_kernel.cc:12] a real error\n  its second line\n"
    )
    assert launched_as_command(["/usr/bin/python", "-m", "kmix", "demo"])
    assert launched_as_command(["/usr/bin/python", "/venv/bin/kmix", "doctor"])
    assert not launched_as_command(["/usr/bin/python", "-m", "pytest", "tests/test_main.py"])
