"""`kmix.device`: this device's facts (`kmix.route.facts`) and its measured probe (`kmix.route.probe`).

    >>> kmix.device.fast_bfloat16()          # from the facts alone, no timing
    True
    >>> print(kmix.device.probe())           # GFLOP/s per dtype, tf.function and XLA
"""

from kmix.route.facts import (BFLOAT16_TENSOR_CORES, CPU_FLAGS, FLOAT16_TENSOR_CORES, cpu_features, describe,
                              fast_bfloat16, gather_facts, gpus, onednn_enabled, tensor_cores)
from kmix.route.probe import DTYPES, MIN_GPU_CALL_S, SCREEN, Probe, gpu_row_limit, plan_rows, probe, size_rows

__all__ = ["BFLOAT16_TENSOR_CORES", "CPU_FLAGS", "DTYPES", "FLOAT16_TENSOR_CORES", "MIN_GPU_CALL_S", "Probe", "SCREEN",
           "cpu_features", "describe", "fast_bfloat16", "gather_facts", "gpu_row_limit", "gpus", "onednn_enabled",
           "plan_rows", "probe", "size_rows", "tensor_cores"]
