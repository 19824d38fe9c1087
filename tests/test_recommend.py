"""`kmix.recommend` and `kmix.device`: every branch of the decision with injected figures, one real probe."""

import time

import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix import device
from kmix.recommendation import FLOAT16_MARGIN, MIN_SPEEDUP, decide, model_shape

CPU_BF16 = {"model": "AMD EPYC", "source": "/proc/cpuinfo", "avx512_bf16": True, "amx_bf16": False,
            "avx512_fp16": False, "avx512f": True}
CPU_PLAIN = {**CPU_BF16, "model": "AMD EPYC (AVX2)", "avx512_bf16": False, "avx512f": False}
CPU_UNKNOWN = {"model": "arm64", "source": None, "avx512_bf16": None, "amx_bf16": None,
               "avx512_fp16": None, "avx512f": None}


def _probe(f32, bf16, f16, where="CPU (test)"):
    """A Probe from `(tf.function, XLA)` GFLOP/s pairs per dtype."""
    figures = {}
    for dtype, (plain, xla) in (("float32", f32), ("bfloat16", bf16), ("float16", f16)):
        figures[(dtype, False)], figures[(dtype, True)] = float(plain), float(xla)
    return device.Probe(where, (1024, 512, 2048), figures, 2.0)


# (name, probe figures, gpus, cpu, policy, jit_compile, words the reasons must contain)
CASES = [
    # This project's CPUs (2026-11-23): oneDNN bfloat16 1.6-1.9x, but not under XLA.
    ("bf16 CPU", _probe((120, 110), (210, 100), (90, 120)), [], CPU_BF16,
     "O1-bfloat16", False, ["AVX512_BF16 yes", "1.75x", "XLA:CPU does not use oneDNN", "210 / 100"]),
    # A CPU without bfloat16 hardware: half precision is no faster.
    ("plain CPU", _probe((120, 130), (60, 55), (30, 125)), [], CPU_PLAIN,
     "float32", True, ["AVX512_BF16 no", "No half dtype", "1.1x", "jit_compile=True"]),
    ("unknown CPU", _probe((50, 40), (52, 41), (20, 20)), [], CPU_UNKNOWN,
     "float32", False, ["features unknown", "No half dtype"]),
    # Volta / Turing: float16 tensor cores, none for bfloat16.
    ("GPU cc 7.5", _probe((14e3, 15e3), (9e3, 9.5e3), (60e3, 65e3), "Tesla T4"),
     [{"name": "Tesla T4", "compute_capability": (7, 5)}], CPU_PLAIN,
     "O1-float16", True, ["compute capability 7.5", "bfloat16 no", "loss scaling", "kmix.wrap"]),
    # Ampere and later: both, as fast as each other: bfloat16, no loss scaling; XLA on.
    ("GPU cc 9.0", _probe((50e3, 52e3), (400e3, 420e3), (405e3, 430e3), "NVIDIA H100"),
     [{"name": "NVIDIA H100", "compute_capability": (9, 0)}], CPU_BF16,
     "O1-bfloat16", True, ["compute capability 9.0", "bfloat16 yes", "no loss scaling", "XLA"]),
]


@pytest.mark.parametrize("name, probe, gpus, cpu, policy, jit, words", CASES, ids=[c[0] for c in CASES])
def test_decide(name, probe, gpus, cpu, policy, jit, words):
    rec = decide(probe, gpus, cpu, onednn=True)
    assert (rec.policy, rec.jit_compile) == (policy, jit)
    assert rec.loss_scaling is (policy == "O1-float16")
    text = str(rec)
    for word in words:
        assert word in text, (word, text)
    # The policy is one every kmix entry point accepts as it is; O1 keeps the outputs float32.
    policy = kmix.Policy(rec.policy)
    assert policy.needs_loss_scaling is rec.loss_scaling and policy.output_dtype == "float32"
    assert policy.name == rec.policy


def test_decide_thresholds():
    # Just under MIN_SPEEDUP: float32; at it: the half dtype.
    below = _probe((100, 90), (100 * MIN_SPEEDUP - 1, 50), (10, 10))
    at = _probe((100, 90), (100 * MIN_SPEEDUP, 50), (10, 10))
    assert decide(below, [], CPU_BF16).policy == "float32"
    assert decide(at, [], CPU_BF16).policy == "O1-bfloat16"
    # float16 wins over bfloat16 only when FLOAT16_MARGIN faster (it needs loss scaling).
    close = _probe((100, 90), (200, 50), (200 * FLOAT16_MARGIN - 1, 50))
    clear = _probe((100, 90), (200, 50), (200 * FLOAT16_MARGIN + 1, 50))
    assert decide(close, [], CPU_BF16).policy == "O1-bfloat16"
    assert decide(clear, [], CPU_BF16).policy == "O1-float16"
    # The XLA note is said only where it explains the choice.
    assert "XLA:CPU" not in str(decide(clear, [], CPU_BF16))


def test_cpu_features_from_a_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n")
    cpu = device.cpu_features(str(path))
    assert cpu == {"model": "Test CPU 9000", "source": str(path), "avx512_bf16": True, "amx_bf16": False,
                   "avx512_fp16": False, "avx512f": True}
    missing = device.cpu_features(str(tmp_path / "absent"))
    assert missing["source"] is None and missing["avx512_bf16"] is None


def test_tensor_cores():
    assert device.tensor_cores(None) == {"float16": False, "bfloat16": False}
    assert device.tensor_cores((6, 0)) == {"float16": False, "bfloat16": False}
    assert device.tensor_cores((7, 5)) == {"float16": True, "bfloat16": False}
    assert device.tensor_cores((8, 0)) == {"float16": True, "bfloat16": True}
    assert device.tensor_cores((10, 0)) == {"float16": True, "bfloat16": True}


def test_a_real_probe_is_short_and_cached():
    start = time.perf_counter()
    probe = device.probe((128, 64, 256), budget=0.05)
    assert time.perf_counter() - start < 5.0
    assert set(probe.gflops) == {(d, j) for d in device.DTYPES for j in (False, True)}
    assert all(rate > 0 for rate in probe.gflops.values())
    assert device.probe((128, 64, 256), budget=0.05) is probe  # cached per process
    rec = kmix.recommend(probe=probe)
    assert rec.probe is probe and rec.policy in ("float32", "O1-bfloat16", "O1-float16")
    assert "Measured on" in str(rec) and "128x64" in str(rec)


class _RowsCost:
    """A stand-in step that costs `seconds_per_row` per row of its first input, and counts its rows."""

    def __init__(self, seconds_per_row):
        self.seconds_per_row, self.rows = seconds_per_row, []

    def __call__(self, x, *rest):
        self.rows.append(int(x.shape[0]))
        time.sleep(self.seconds_per_row * int(x.shape[0]))
        return tf.zeros(())


def test_a_slow_configuration_is_timed_on_a_slice_of_the_rows():
    x = np.zeros((160, 4), "float32")
    slow = _RowsCost(2e-3)  # 0.32 s a full call: over the budget, so 10 rows (0.02 s) tell the rate
    rows, seconds = device._time_rows(slow, [x], budget=0.05)
    assert rows == 10 and slow.rows == [10, 10] and 0.02 <= seconds < 0.2
    fast = _RowsCost(1e-5)  # 1.6 ms a full call: timed at full size, at least three calls
    rows, seconds = device._time_rows(fast, [x], budget=0.05)
    assert rows == 160 and fast.rows[:2] == [10, 10] and set(fast.rows[2:]) == {160}
    assert len(fast.rows) >= 2 + 1 + 3 and seconds >= 1.6e-3


def test_probe_shape_from_a_model_and_bad_shape():
    import keras

    model = keras.Sequential([keras.Input((48,)), keras.layers.Dense(96), keras.layers.Dense(32),
                              keras.layers.Dense(96)])
    assert model_shape(model) == (1024, 48, 96)  # median in: (48, 96, 32); out: (96, 32, 96)
    with pytest.raises(ValueError, match=r"shape=\(1, 2\)"):
        device.probe((1, 2))
