"""`kmix.recommend`'s decision and `kmix.device`: every branch with injected figures, and a real probe."""

import time

import numpy as np
import pytest

import kmix
from kmix import device
from kmix.route.recommendation import decide, decide_routes, model_shape
from kmix.route.rule import FLOAT16_MARGIN, MIN_SPEEDUP, candidates, choose
from tests.route.fakes import CPU_BF16, CPU_PLAIN, CPU_UNKNOWN, STEADY, fake_probe, fake_rounds_probe, route_table

# (name, probe figures, gpus, cpu, policy, jit_compile, words the reasons must contain)
CASES = [
    # This project's CPUs (2026-11-23): oneDNN bfloat16 1.6-1.9x, but not under XLA.
    ("bf16 CPU", fake_probe((120, 110), (210, 100), (90, 120)), [], CPU_BF16,
     "O1-bfloat16", False, ["AVX512_BF16 yes", "1.75x", "XLA:CPU does not use oneDNN", "210 / 100"]),
    # A CPU without bfloat16 hardware: half precision is no faster.
    ("plain CPU", fake_probe((120, 130), (60, 55), (30, 125)), [], CPU_PLAIN,
     "float32", True, ["AVX512_BF16 no", "No half dtype", "1.1x", "jit_compile=True"]),
    ("unknown CPU", fake_probe((50, 40), (52, 41), (20, 20)), [], CPU_UNKNOWN,
     "float32", False, ["features unknown", "No half dtype"]),
    # Volta / Turing: float16 tensor cores, none for bfloat16.
    ("GPU cc 7.5", fake_probe((14e3, 15e3), (9e3, 9.5e3), (60e3, 65e3), "Tesla T4"),
     [{"name": "Tesla T4", "compute_capability": (7, 5)}], CPU_PLAIN,
     "O1-float16", True, ["compute capability 7.5", "bfloat16 no", "loss scaling", "kmix.wrap"]),
    # Ampere and later: both, as fast as each other: bfloat16, no loss scaling; XLA on.
    ("GPU cc 9.0", fake_probe((50e3, 52e3), (400e3, 420e3), (405e3, 430e3), "NVIDIA H100"),
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
    below = fake_probe((100, 90), (100 * MIN_SPEEDUP - 1, 50), (10, 10))
    at = fake_probe((100, 90), (100 * MIN_SPEEDUP, 50), (10, 10))
    assert decide(below, [], CPU_BF16).policy == "float32"
    assert decide(at, [], CPU_BF16).policy == "O1-bfloat16"
    # float16 wins over bfloat16 only when FLOAT16_MARGIN faster (it needs loss scaling).
    close = fake_probe((100, 90), (200, 50), (200 * FLOAT16_MARGIN - 1, 50))
    clear = fake_probe((100, 90), (200, 50), (200 * FLOAT16_MARGIN + 1, 50))
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


def test_a_real_probe_is_short_cached_and_at_one_size():
    start = time.perf_counter()
    probe = device.probe((128, 64, 256), budget=0.05)
    assert time.perf_counter() - start < 30.0  # a few seconds on an idle 2-core CPU
    assert set(probe.gflops) == {(d, j) for d in device.DTYPES for j in (False, True)}
    assert all(rate > 0 for rate in probe.gflops.values())
    # Every configuration compared was timed at the same size, in the same interleaved rounds.
    assert probe.rows in (128, 8) and set(probe.rounds) | set(probe.screened) == set(probe.gflops)
    assert not set(probe.rounds) & set(probe.screened)
    assert len({len(r) for r in probe.rounds.values()}) == 1 and len(next(iter(probe.rounds.values()))) >= 7
    for config, seconds in probe.rounds.items():
        assert probe.gflops[config] == pytest.approx(12 * probe.rows * 64 * 256 / np.median(seconds) / 1e9)
    assert device.probe((128, 64, 256), budget=0.05) is probe  # cached per process
    rec = kmix.recommend(probe=probe)
    assert rec.probe is probe and rec.policy in ("float32", "O1-bfloat16", "O1-float16")
    assert "Measured on" in str(rec) and "x 128x64" in str(rec) or "x 8x64" in str(rec)


def test_probe_sizes_every_configuration_alike_and_screens_slow_halves():
    first = {("float32", False): 0.010, ("float32", True): 0.012, ("bfloat16", False): 0.006,
             ("bfloat16", True): 0.011, ("float16", False): 0.200, ("float16", True): 0.012}
    # The fastest full-size call (16 x 0.006 s) fits a budget of 0.1 s: every configuration at m rows.
    rows, screened = device.plan_rows(first, 1024, 64, budget=0.1)
    assert rows == 1024 and screened == (("float16", False),)  # 33x slower than the fastest
    # It does not fit 0.05 s: every configuration at the small size, none at full size.
    assert device.plan_rows(first, 1024, 64, budget=0.05)[0] == 64
    # float32 is the reference: never screened, however slow (TF32-less float32 on a GPU).
    slow32 = {**first, ("float32", False): 1.0, ("float32", True): 1.0}
    assert not [c for c in device.plan_rows(slow32, 1024, 64, 0.1)[1] if c[0] == "float32"]




def test_a_half_dtype_wins_only_beyond_the_noise():
    # bfloat16 1.25x float32 in the median, in both cases; the rounds differ.
    steady = [t / 1.25 for t in STEADY]
    noisy = [1.0 / 1.25, 1.01 / 1.8, 0.99 / 1.25, 1.0 / 0.7, 1.0 / 0.9]  # ratios 1.25, 1.8, 1.25, 0.7, 0.9
    slow = [2.0] * 5
    rec = decide(fake_rounds_probe((STEADY, slow), (steady, slow), (slow, slow)), [], CPU_BF16, True)
    assert rec.policy == "O1-bfloat16" and "1.25x" in str(rec)
    rec = decide(fake_rounds_probe((STEADY, slow), (noisy, slow), (slow, slow)), [], CPU_BF16, True)
    assert rec.policy == "float32" and "noise" in str(rec)
    # float16 on a CPU without float16 arithmetic: under XLA level with float32 (XLA computes it in
    # float32), a little faster within the noise: never picked, run after run.
    for jitter in (0.97, 1.0, 1.03):
        f16 = [t * jitter for t in STEADY]
        rec = decide(fake_rounds_probe((slow, STEADY), (slow, STEADY), (slow, f16)), [], CPU_PLAIN, False)
        assert (rec.policy, rec.jit_compile) == ("float32", True)


def test_compilation_within_the_noise_floor_is_kerass_default():
    times = {("float32", False): STEADY, ("float32", True): [t * 0.98 for t in STEADY]}
    assert choose(times, False, 1.0, 1.0).route == ("float32", False)  # 2% apart: Keras's CPU default
    assert choose(times, True, 1.0, 1.0).route == ("float32", True)
    times[("float32", True)] = [t * 0.9 for t in STEADY]  # 10%: the faster one, whatever the default
    assert choose(times, False, 1.0, 1.0).route == ("float32", True)



def test_decide_on_a_models_table():
    beyond = route_table(float32_tf=STEADY, float32_xla=[1.3] * 5, O1_bfloat16_tf=[t / 1.06 for t in STEADY],
                    O1_bfloat16_xla=[1.4] * 5)
    rec = decide_routes(beyond, None, [], CPU_BF16, True)
    assert (rec.policy, rec.jit_compile) == ("O1-bfloat16", False)  # 6% beyond a 3% noise floor
    assert rec.table.chosen == 2 and rec.table.reference == 0
    text = str(rec)
    assert "1.06x float32's reference route" in text and "<- recommended" in text and "x float32" in text
    within = route_table(float32_tf=STEADY, float32_xla=[1.3] * 5, O1_bfloat16_tf=[t / 1.02 for t in STEADY],
                    O1_bfloat16_xla=[1.4] * 5)
    rec = decide_routes(within, None, [], CPU_BF16, True)
    assert (rec.policy, rec.jit_compile) == ("float32", False) and "No half route" in str(rec)
    # float16 over bfloat16 only when faster beyond the noise; loss scaling said.
    both = route_table(float32_tf=STEADY, O1_bfloat16_tf=[t / 2 for t in STEADY], O1_float16_tf=[t / 2.04 for t in STEADY])
    assert decide_routes(both, None, [], CPU_BF16).policy == "O1-bfloat16"
    clear = route_table(float32_tf=STEADY, O1_bfloat16_tf=[t / 2 for t in STEADY], O1_float16_tf=[t / 2.5 for t in STEADY])
    rec = decide_routes(clear, None, [{"name": "T4", "compute_capability": (7, 5)}], CPU_PLAIN)
    assert rec.policy == "O1-float16" and rec.loss_scaling and "loss scale" in str(rec)


def test_candidates_from_the_probe():
    slow = [10.0] * 5
    # bfloat16 0.9x float32 (kept: a model may gain where the MLP does not); float16 no faster than it.
    probe = fake_rounds_probe((STEADY, slow), ([t / 0.9 for t in STEADY], slow), ([t / 0.9 for t in STEADY], slow))
    dtypes, skipped = candidates(probe)
    assert dtypes == ["float32", "bfloat16"] and skipped[0][0] == "float16" and "no faster" in skipped[0][1]
    probe = fake_rounds_probe((STEADY, slow), ([t / 0.5 for t in STEADY], slow), ([t / 2 for t in STEADY], slow))
    dtypes, skipped = candidates(probe)
    assert dtypes == ["float32", "float16"] and "0.50x" in skipped[0][1]


def test_probe_shape_from_a_model_and_bad_shape():
    import keras

    model = keras.Sequential([keras.Input((48,)), keras.layers.Dense(96), keras.layers.Dense(32),
                              keras.layers.Dense(96)])
    assert model_shape(model) == (1024, 48, 96)  # median in: (48, 96, 32); out: (96, 32, 96)
    with pytest.raises(ValueError, match=r"shape=\(1, 2\)"):
        device.probe((1, 2))
