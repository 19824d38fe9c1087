"""`kmix.device`: this device's facts and its measured probe, in one namespace.

The facts (`kmix.route.facts`) explain a route without timing anything:
the GPUs' compute capabilities and tensor cores, the CPU's half-precision
features, whether oneDNN is on. The probe (`kmix.route.probe`) times the
training step of a transformer's MLP in float32, bfloat16 and float16, as
a `tf.function` and under XLA, in interleaved rounds; a few seconds, cached
per process, size and TF32 setting (on a GPU its rows grow until a call is
not bound by kernel launches). `kmix.recommend()` decides from the probe, and with a
model tells from it which half dtypes are worth timing there.

    >>> import kmix
    >>> kmix.device.cpu_features()["avx512_bf16"]
    True
    >>> kmix.device.fast_bfloat16()          # from the facts alone, no timing
    True
    >>> print(kmix.device.probe())           # GFLOP/s per dtype, tf.function and XLA
"""

from kmix.route.facts import (  # noqa: F401  (the public namespace)
    BFLOAT16_TENSOR_CORES,
    CPU_FLAGS,
    FLOAT16_TENSOR_CORES,
    cpu_features,
    describe,
    fast_bfloat16,
    gather_facts,
    gpus,
    onednn_enabled,
    tensor_cores,
)
from kmix.route.probe import (  # noqa: F401
    DTYPES,
    MIN_GPU_CALL_S,
    SCREEN,
    Probe,
    gpu_row_limit,
    plan_rows,
    probe,
    size_rows,
)

__all__ = [
    "BFLOAT16_TENSOR_CORES",
    "CPU_FLAGS",
    "DTYPES",
    "FLOAT16_TENSOR_CORES",
    "MIN_GPU_CALL_S",
    "Probe",
    "SCREEN",
    "cpu_features",
    "describe",
    "fast_bfloat16",
    "gather_facts",
    "gpu_row_limit",
    "gpus",
    "onednn_enabled",
    "plan_rows",
    "probe",
    "size_rows",
    "tensor_cores",
]
