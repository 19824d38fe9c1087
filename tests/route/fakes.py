"""Injected device figures for the recommendation tests: CPUs, probes in GFLOP/s or seconds per round, route tables."""

import numpy as np

from kmix import device
from kmix.route import trials

CPU_BF16 = {"model": "AMD EPYC", "source": "/proc/cpuinfo", "avx512_bf16": True, "amx_bf16": False,
            "avx512_fp16": False, "avx512f": True}
CPU_PLAIN = {**CPU_BF16, "model": "AMD EPYC (AVX2)", "avx512_bf16": False, "avx512f": False}
CPU_UNKNOWN = {"model": "arm64", "source": None, "avx512_bf16": None, "amx_bf16": None,
               "avx512_fp16": None, "avx512f": None}


def fake_probe(f32, bf16, f16, where="CPU (test)"):
    """A Probe from `(tf.function, XLA)` GFLOP/s pairs per dtype."""
    figures = {}
    for dtype, (plain, xla) in (("float32", f32), ("bfloat16", bf16), ("float16", f16)):
        figures[(dtype, False)], figures[(dtype, True)] = float(plain), float(xla)
    return device.Probe(where, (1024, 512, 2048), figures, 2.0)


# Given to the calls that test something else than the probe: where the budget times no half route, the probe
# decides, and a given one costs no measurement.
FAKE_PROBE = fake_probe((120, 110), (210, 100), (90, 120))


def fake_rounds_probe(f32, bf16, f16):
    """A Probe from `(tf.function, XLA)` seconds-per-round lists per dtype."""
    rounds = {}
    for dtype, (plain, xla) in (("float32", f32), ("bfloat16", bf16), ("float16", f16)):
        rounds[(dtype, False)], rounds[(dtype, True)] = tuple(plain), tuple(xla)
    gflops = {config: 1.0 / float(np.median(seconds)) for config, seconds in rounds.items()}
    return device.Probe("CPU (test)", (1024, 512, 2048), gflops, 1.0, rounds, 1024)


STEADY = [1.0, 1.01, 0.99, 1.0, 1.0]


def route_table(**routes):
    """A RouteTable from `policy_jit=[seconds per round]` keyword arguments (jit: `tf` or `xla`)."""
    timings = [trials.RouteTiming(name.rsplit("_", 1)[0].replace("_", "-"), name.endswith("xla"), tuple(v), 1.0, 1)
               for name, v in routes.items()]
    return trials.RouteTable(tuple(timings), batch="a batch of 8 rows")

