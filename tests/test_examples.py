"""Runs every script in examples/ with tiny settings, as `__main__` in this process, and checks its result line.

Each example ends with `result: key=value ...`; the checks compare the loss
on held-out data after training with the loss before it, and the counters
with what the settings imply (a NaN batch is exactly one skipped step, which
halves the scale once). In this process rather than in a subprocess each: a
TensorFlow start per example cost more than most examples' training. The
process's TensorFlow is configured as the scripts configure it (two logical
CPUs, tests/conftest.py; mirrored_strategy.py asks for the same).
"""

import math
import os
import runpy
import sys

import pytest
import tensorflow as tf

from tests.testing import full_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {
    "masked_attention_transformer": ["--steps", "20", "--seq", "16", "--batch", "16"],
    "image_classifier": ["--steps", "30", "--batch", "32"],  # float16 convolutions: ~0.36 s a step on a CPU
    "custom_training_loop": ["--steps", "20", "--batch", "32", "--bad-batch", "5"],
    "mirrored_strategy": ["--steps", "20", "--batch", "32", "--bad-batch", "3"],
    # Its workers are two more TensorFlow processes; tests/distribute runs the same fit by default.
    "multi_worker_fit": ["--epochs", "2", "--batches", "10", "--bad-batch", "3", "--timeout", "200"],
}


@pytest.fixture
def run_example(capsys, monkeypatch):
    """`run_example(name)`: runs examples/NAME.py with its RUNS arguments as `python NAME.py ARGS` would
    (`__name__ == "__main__"`, `sys.argv`); returns what it printed. The policy it sets is reset after the test
    (tests/conftest.py)."""

    def run(name):
        path = os.path.join(ROOT, "examples", name + ".py")
        monkeypatch.setattr(sys, "argv", [path, *RUNS[name]])
        capsys.readouterr()
        runpy.run_path(path, run_name="__main__")
        return capsys.readouterr().out

    return run


def result_of(out):
    """The example's `result:` line, parsed (numbers as floats, True/False as bools)."""
    lines = [line for line in out.splitlines() if line.startswith("result: ")]
    assert len(lines) == 1, out[-3000:]
    values = dict(item.split("=", 1) for item in lines[0][len("result: "):].split())
    parsed = {}
    for key, value in values.items():
        parsed[key] = {"True": True, "False": False}.get(value, value)
        if isinstance(parsed[key], str):
            parsed[key] = float(value)
    return parsed


def assert_learned(result, factor):
    assert math.isfinite(result["initial_loss"]) and math.isfinite(result["final_loss"])
    assert result["final_loss"] < factor * result["initial_loss"], result


def test_masked_attention_transformer(run_example):
    result = result_of(run_example("masked_attention_transformer"))
    assert_learned(result, 0.5)
    assert result["accuracy"] > 0.8
    assert result["skipped_steps"] == 0 and result["loss_scale"] == 2.0**15


def test_image_classifier(run_example):
    out = run_example("image_classifier")
    result = result_of(out)
    assert_learned(result, 0.8)
    assert result["accuracy"] > 0.4  # four classes: chance is 0.25
    # The autocast table: convolutions in half, batch norm in float32, the output layer's matmul in
    # half with its softmax and output in float32.
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1]}
    assert rows["conv2d"][3] == "mixed_float16"
    assert rows["batch_normalization"][3] == "float32"
    assert rows["probabilities"][3] == "mixed_float16" and "float32" in " ".join(rows["probabilities"][4:])
    # LossScaleWarmup started the scale at 2^7; it only doubles or halves from there.
    assert math.log2(result["loss_scale"]) == int(math.log2(result["loss_scale"]))
    assert result["loss_scale"] >= 2.0**7 / 2.0 ** result["skipped_steps"]


def test_custom_training_loop(run_example):
    out = run_example("custom_training_loop")
    result = result_of(out)
    assert_learned(result, 0.5)
    assert result["skipped_steps"] == 1
    assert result["loss_scale"] == 2.0**14  # 2^15 halved once, no growth within 2000 steps
    assert "overflows per variable" in out


def test_mirrored_strategy(run_example):
    result = result_of(run_example("mirrored_strategy"))
    assert_learned(result, 0.5)
    gpus = len(tf.config.list_physical_devices("GPU"))
    assert result["replicas"] == (gpus or 2)  # two logical CPUs without a GPU
    assert result["replicas_agree"] is True
    assert result["skipped_steps"] == 1 and result["loss_scale"] == 2.0**14


@full_only("two more TensorFlow processes")
def test_multi_worker_fit(run_example):
    """Two MultiWorkerMirroredStrategy workers on 127.0.0.1 (started, and killed by pid, by the example)."""
    out = run_example("multi_worker_fit")
    result = result_of(out)
    assert_learned(result, 0.8)
    assert result["replicas"] == 2 and result["workers_agree"] is True
    checksums = [line.split("checksum=")[1].split()[0] for line in out.splitlines() if "checksum=" in line]
    assert len(checksums) == 2 and checksums[0] == checksums[1]
    assert result["skipped_steps"] == 2  # the inf batch, once per epoch, on both workers
    assert result["loss_scale"] == 2.0**13
