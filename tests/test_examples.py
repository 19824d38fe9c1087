"""Runs every script in examples/ with tiny settings, in subprocesses, and checks its result line.

Each example ends with `result: key=value ...`; the checks compare the loss
on held-out data after training with the loss before it, and the counters
with what the settings imply (a NaN batch is exactly one skipped step, which
halves the scale once).
"""

import math
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tests.testing import FULL, full_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {
    "masked_attention_transformer": ["--steps", "30"],
    "image_classifier": ["--steps", "60"],
    "custom_training_loop": ["--steps", "30", "--bad-batch", "5"],
    "mirrored_strategy": ["--steps", "30", "--bad-batch", "3"],
}
if FULL:  # its workers are three more TensorFlow processes; tests/distribute runs the same fit by default
    RUNS["multi_worker_fit"] = ["--epochs", "2", "--batches", "10", "--bad-batch", "3", "--timeout", "200"]
TIMEOUT = 240


@pytest.fixture(scope="module")
def outputs():
    """Starts all examples at once (they are mostly waiting on imports), then collects them."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    procs = {
        name: subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "examples", name + ".py"), *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, args in RUNS.items()
    }
    results = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = (proc.returncode, out, err)
    return results


def result_of(outputs, name):
    code, out, err = outputs[name]
    assert code == 0, f"{name} exited with {code}:\n{out[-3000:]}\n{err[-3000:]}"
    lines = [line for line in out.splitlines() if line.startswith("result: ")]
    assert len(lines) == 1, out[-3000:]
    values = dict(item.split("=", 1) for item in lines[0][len("result: "):].split())
    parsed = {}
    for key, value in values.items():
        parsed[key] = {"True": True, "False": False}.get(value, value)
        if isinstance(parsed[key], str):
            parsed[key] = float(value)
    return parsed, out


def assert_learned(result, factor):
    assert math.isfinite(result["initial_loss"]) and math.isfinite(result["final_loss"])
    assert result["final_loss"] < factor * result["initial_loss"], result


def test_masked_attention_transformer(outputs):
    result, _ = result_of(outputs, "masked_attention_transformer")
    assert_learned(result, 0.5)
    assert result["accuracy"] > 0.8
    assert result["skipped_steps"] == 0 and result["loss_scale"] == 2.0**15


def test_image_classifier(outputs):
    result, out = result_of(outputs, "image_classifier")
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


def test_custom_training_loop(outputs):
    result, out = result_of(outputs, "custom_training_loop")
    assert_learned(result, 0.5)
    assert result["skipped_steps"] == 1
    assert result["loss_scale"] == 2.0**14  # 2^15 halved once, no growth within 2000 steps
    assert "overflows per variable" in out


def test_mirrored_strategy(outputs):
    result, _ = result_of(outputs, "mirrored_strategy")
    assert_learned(result, 0.5)
    gpus = len(tf.config.list_physical_devices("GPU"))
    assert result["replicas"] == (gpus or 2)  # two logical CPUs without a GPU
    assert result["replicas_agree"] is True
    assert result["skipped_steps"] == 1 and result["loss_scale"] == 2.0**14


@full_only("three TensorFlow processes beside the other examples")
def test_multi_worker_fit(outputs):
    """Two MultiWorkerMirroredStrategy workers on 127.0.0.1 (started, and killed by pid, by the example)."""
    result, out = result_of(outputs, "multi_worker_fit")
    assert_learned(result, 0.8)
    assert result["replicas"] == 2 and result["workers_agree"] is True
    checksums = [line.split("checksum=")[1].split()[0] for line in out.splitlines() if "checksum=" in line]
    assert len(checksums) == 2 and checksums[0] == checksums[1]
    assert result["skipped_steps"] == 2  # the inf batch, once per epoch, on both workers
    assert result["loss_scale"] == 2.0**13
