"""`python -m kmix doctor`: the recommendation for every kind of device, and the report."""

import platform

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix.route import doctor, onednn, probe, recommendation, timing
from kmix.route.recommendation import Recommendation
from tests.testing import full_only


def _recommendation(policy="O1-bfloat16", jit=True):
    return Recommendation(policy, jit, ("a reason",), policy == "O1-float16", None)


def test_report_for_a_gpu():
    facts = {
        "versions": {"python": "3.11", "tensorflow": "2.21", "keras": "3.15", "numpy": "2.0", "kmix": "0.1"},
        "gpus": [{"name": "NVIDIA H200", "compute_capability": (9, 0)}],
        "cpu": "x86_64, 16 core(s)",
        "built_with_cuda": True,
        "cuda": "12.5",
        "cudnn": "9",
        "tf32": True,
        "xla": "yes",
    }
    text = doctor.format_report(facts, _recommendation())
    assert "NVIDIA H200" in text
    assert "compute capability      9.0" in text
    assert "bfloat16 tensor cores   yes" in text
    assert "kmix.autocast(model, 'O1-bfloat16')" in text and "jit_compile=True" in text


@pytest.fixture
def small_probe(monkeypatch):
    """`doctor.main`'s probe at a small shape: the same measurement (every dtype, tf.function and XLA) in under
    half the default shape's time (test_recommendation.py checks a real probe at its own size)."""
    monkeypatch.setattr(recommendation, "measure_probe",
                        lambda shape, budget, limit_s: probe.probe((64, 16, 32), 0.02, limit_s))


def test_main_prints_versions_and_recommendation(capsys, small_probe):
    """The versions, the facts, and the route the probe measured, with its figures."""
    result = doctor.main([])
    out = capsys.readouterr().out
    for name, version in [
        ("python", platform.python_version()),
        ("tensorflow", tf.__version__),
        ("keras", keras.__version__),
        ("numpy", np.__version__),
        ("kmix", kmix.__version__),
    ]:
        assert f"{name:<11} {version}" in out
    gpus = tf.config.list_physical_devices("GPU")
    assert len(result["facts"]["gpus"]) == len(gpus)
    assert result["facts"]["xla"].startswith("yes")
    rec = result["recommendation"]
    # The printed route is the one kmix.recommend measured, with its figures.
    assert f"Recommended: policy {rec.policy!r}, jit_compile={rec.jit_compile}" in out
    assert "Measured on" in out and "tf.function" in out
    cpu = result["facts"]["cpu_features"]
    if cpu["source"]:
        assert f"AVX512_BF16  {'yes' if cpu['avx512_bf16'] else 'no'}" in out


def _facts(gpus, tf32=True, built_with_cuda=True, visible=None, driver=None):
    return {
        "versions": {"python": "3.11"}, "gpus": gpus, "cpu": "x86_64, 2 core(s)",
        "built_with_cuda": built_with_cuda, "cuda": "12.5", "cudnn": "9", "tf32": tf32,
        "xla": "yes", "cuda_visible_devices": visible, "nvidia_driver": driver,
    }


def test_tf32_is_reported_only_for_a_gpu_that_has_it():
    line = lambda gpus, tf32=True: doctor.tf32_line(_facts(gpus, tf32))  # noqa: E731
    assert line([]).startswith("not applicable (no GPU")
    assert line([{"name": "T4", "compute_capability": (7, 5)}]).startswith("not applicable")
    assert line([{"name": "H100", "compute_capability": (9, 0)}]).startswith("enabled on every GPU")
    assert line([{"name": "H100", "compute_capability": (9, 0)}], tf32=False).startswith("disabled")
    two = [{"name": "A100", "compute_capability": (8, 0)}, {"name": "V100", "compute_capability": (7, 0)}]
    assert line(two).startswith("enabled on GPU 0 ")
    report = doctor.format_report(_facts([]), _recommendation("float32", False))
    assert "TF32        not applicable" in report and "TF32        enabled" not in report


def test_why_a_cuda_build_sees_no_gpu():
    assert doctor.why_no_gpu(_facts([{"name": "H100", "compute_capability": (9, 0)}])) is None
    assert doctor.why_no_gpu(_facts([], built_with_cuda=False)) is None
    for hidden in ("", "-1"):
        reason = doctor.why_no_gpu(_facts([], visible=hidden, driver="NVRM version: 550"))
        assert f"CUDA_VISIBLE_DEVICES is set to {hidden!r}" in reason
    assert "no NVIDIA driver" in doctor.why_no_gpu(_facts([]))
    reason = doctor.why_no_gpu(_facts([], visible="3", driver="NVRM version: 550"))
    assert "driver is loaded" in reason and "CUDA_VISIBLE_DEVICES='3'" in reason
    report = doctor.format_report(_facts([], visible=""), _recommendation("float32", False))
    assert "CUDA_VISIBLE_DEVICES is set to ''" in report


def test_doctor_with_cuda_visible_devices_empty_says_why(monkeypatch, capsys, small_probe):
    """`main` with the variable set empty: the reason matches this TensorFlow build and its GPUs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = doctor.main([])
    out = capsys.readouterr().out
    assert result["facts"]["cuda_visible_devices"] == ""
    no_gpu = not tf.config.list_physical_devices("GPU")
    assert ("CUDA_VISIBLE_DEVICES is set to ''" in out) is (no_gpu and tf.test.is_built_with_cuda())
    assert ("TF32        not applicable (no GPU" in out) is no_gpu


def _comparison(ratio_on, noise_rounds=(1.0, 1.0, 1.0), enabled_on=True):
    """A Comparison where oneDNN on runs `ratio_on` times as fast as off, round by round."""
    off = {config: [0.1 * r for r in noise_rounds] for config in onednn.CONFIGS}
    on = {config: [0.1 / ratio_on for _ in noise_rounds] for config in onednn.CONFIGS}
    on[("bfloat16", False)] = [t / 1.5 for t in on[("bfloat16", False)]]  # the fastest with oneDNN
    best_on, best_off = ("bfloat16", False), ("float32", False)
    ratio, noise = timing.paired(off[best_off], on[best_on])
    return onednn.Comparison(on, off, best_on, best_off, ratio, noise, (1024, 512, 2048), 12.0,
                              {"on": enabled_on, "off": False})


def test_onednn_lines_say_whether_to_set_it_and_how():
    faster = "\n".join(doctor.onednn_lines(_comparison(1.2)))  # 1.8x with bfloat16
    assert "runs 1.80x as fast" in faster and "export TF_ENABLE_ONEDNN_OPTS=1" in faster
    assert "before `import tensorflow`" in faster and "bfloat16, tf.function" in faster
    assert "3 interleaved rounds" in faster and "two subprocesses" in faster
    noisy = "\n".join(doctor.onednn_lines(_comparison(0.6, noise_rounds=(1.0, 1.6, 0.7))))
    assert "not beyond the noise" in noisy and "export" not in noisy
    refused = "\n".join(doctor.onednn_lines(_comparison(1.2, enabled_on=False)))
    assert "did not turn oneDNN on" in refused and "export" not in refused
    report = doctor.format_report({**_facts([], built_with_cuda=False), "onednn": False},
                                  _recommendation("float32", True), _comparison(1.2))
    assert "oneDNN      off" in report and "export TF_ENABLE_ONEDNN_OPTS=1" in report


@full_only("two worker processes, about 20 s on 2 cores")
def test_onednn_comparison_runs_two_workers_interleaved():
    """Both settings for real, on a small step: each worker's TensorFlow has oneDNN as it was asked."""
    result = onednn.compare(shape=(64, 32, 64), rounds=2)
    assert result.enabled["off"] is False
    assert set(result.on) == set(result.off) == set(onednn.CONFIGS)
    assert all(len(v) == 2 and min(v) > 0 for v in [*result.on.values(), *result.off.values()])
    assert result.best_on in onednn.CONFIGS and result.ratio > 0 and result.noise >= timing.NOISE_FLOOR
    lines = doctor.onednn_lines(result)
    assert lines[0].startswith("TF_ENABLE_ONEDNN_OPTS=1 against =0") and "64x32x64" in lines[0]


def test_doctor_names_the_serving_route_of_the_recommended_policy():
    half = doctor.format_report(_facts([]), _recommendation("O1-bfloat16", False))
    assert "kmix.export(model, path, dtype='bfloat16')" in half
    full = doctor.format_report(_facts([]), _recommendation("float32", False))
    assert "model.export(path)  # float32" in full and "# weights in" not in full
