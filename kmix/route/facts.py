"""Device facts that explain a route, read without timing anything: GPUs, CPU features, oneDNN, versions."""

import os
import platform

import keras
import numpy as np
import tensorflow as tf

from kmix._compat import onednn_enabled

FLOAT16_TENSOR_CORES = (7, 0)  # Volta
BFLOAT16_TENSOR_CORES = (8, 0)  # Ampere
CPU_FLAGS = {  # /proc/cpuinfo flag -> what it gives half precision
    "avx512_bf16": "bfloat16 dot products (oneDNN's bfloat16 matmuls)",
    "amx_bf16": "AMX bfloat16 tiles (Sapphire Rapids and later)",
    "avx512_fp16": "float16 arithmetic (Sapphire Rapids and later)",
    "avx512f": "AVX-512 (oneDNN on by default in TensorFlow)",
}


def tensor_cores(compute_capability):
    """`{"float16": bool, "bfloat16": bool}`: which half dtypes have tensor cores at `(major, minor)` (None: no GPU).

        >>> tensor_cores((7, 5))
        {'float16': True, 'bfloat16': False}
    """
    if compute_capability is None:
        return {"float16": False, "bfloat16": False}
    cc = tuple(compute_capability)
    return {"float16": cc >= FLOAT16_TENSOR_CORES, "bfloat16": cc >= BFLOAT16_TENSOR_CORES}


def cpu_features(cpuinfo_path="/proc/cpuinfo"):
    """The CPU's `model`, the `source` read (`cpuinfo_path`; None: unreadable), each of `CPU_FLAGS` (None: unknown)."""
    try:
        with open(cpuinfo_path) as f:
            text = f.read()
    except OSError:
        return {"model": platform.processor() or platform.machine() or "unknown", "source": None,
                **dict.fromkeys(CPU_FLAGS)}
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return {"model": model or platform.machine() or "unknown", "source": cpuinfo_path,
            **{flag: flag in flags for flag in CPU_FLAGS}}


def gpus():
    """One dict per GPU TensorFlow sees: `name` and `compute_capability` (`(major, minor)` or None)."""
    found = []
    for device in tf.config.list_physical_devices("GPU"):
        try:
            details = tf.config.experimental.get_device_details(device)
        except (ValueError, RuntimeError):
            details = {}
        found.append({"name": details.get("device_name", device.name),
                      "compute_capability": details.get("compute_capability")})
    return found


def fast_bfloat16():
    """Whether this device has bfloat16 hardware, from the facts alone (no timing).

    GPUs that all have compute capability 8.0+, or no GPU and a CPU with AVX512_BF16 or AMX-BF16 and oneDNN on.
    """
    found = gpus()
    if found:
        return all(tensor_cores(g["compute_capability"])["bfloat16"] for g in found)
    cpu = cpu_features()
    return bool(cpu["avx512_bf16"] or cpu["amx_bf16"]) and onednn_enabled()


def describe(gpus, cpu, onednn):
    """The facts of `gpus()`, `cpu_features()` and `onednn_enabled()` (None: unknown) that explain a route, in one line.

        >>> describe([], cpu_features(), onednn_enabled())
        'CPU: AMD EPYC; AVX512_BF16 yes, AMX-BF16 no, AVX512_FP16 no; oneDNN on; no GPU.'
    """
    if gpus:
        shown = []
        for gpu in gpus:
            cores = tensor_cores(gpu["compute_capability"])
            shown.append(f"{gpu['name']} (compute capability {capability(gpu['compute_capability'])}: float16 tensor "
                         f"cores {yes_no(cores['float16'])}, bfloat16 {yes_no(cores['bfloat16'])})")
        return "GPU: " + "; ".join(shown) + "."
    flags = ", ".join(f"{shown} {yes_no(cpu.get(name))}" for name, shown in
                      (("avx512_bf16", "AVX512_BF16"), ("amx_bf16", "AMX-BF16"), ("avx512_fp16", "AVX512_FP16")))
    where = "" if cpu.get("source") else " (no /proc/cpuinfo: features unknown)"
    return f"CPU: {cpu.get('model', 'unknown')}{where}; {flags}; oneDNN {yes_no(onednn, 'on', 'off')}; no GPU."


def yes_no(flag, yes="yes", no="no"):
    """`yes`, `no` or `"unknown"` (None), as the reports print a fact."""
    return {True: yes, False: no, None: "unknown"}[flag]


def capability(compute_capability):
    """`"8.6"`, or `"unknown"` (None), as the reports print a compute capability."""
    return "unknown" if compute_capability is None else "{}.{}".format(*compute_capability)


def gather_facts():
    """Versions, devices and capabilities of this machine, as a dict.

    Keys: `versions` (Python, TensorFlow, Keras, NumPy), `gpus`, `cpu`, `cpu_features`, `onednn`, `built_with_cuda`,
    `cuda` / `cudnn` (or None), `tf32`, `xla` ("yes" or why not), `cuda_visible_devices`, `nvidia_driver` (or None).
    """
    build = tf.sysconfig.get_build_info()
    return {"versions": {"python": platform.python_version(), "tensorflow": tf.__version__,
                         "keras": keras.__version__, "numpy": np.__version__},
            "gpus": gpus(), "cpu": f"{platform.machine() or 'unknown'}, {os.cpu_count() or '?'} core(s)",
            "cpu_features": cpu_features(), "onednn": onednn_enabled(), "built_with_cuda": tf.test.is_built_with_cuda(),
            "cuda": build.get("cuda_version"), "cudnn": build.get("cudnn_version"),
            "tf32": tf.config.experimental.tensor_float_32_execution_enabled(), "xla": _check_xla(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "nvidia_driver": _nvidia_driver()}


def _nvidia_driver():
    """The NVIDIA kernel driver's version line, or None when no driver is loaded (Linux)."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip() or None
    except OSError:
        return None


def _check_xla():
    """Compiles and runs a tiny function with XLA; "yes" or the reason it failed."""
    try:
        float(tf.function(lambda x: tf.reduce_sum(tf.matmul(x, x)), jit_compile=True)(tf.ones((4, 4))))
        return "yes (a jit_compile=True function compiled and ran)"
    except (tf.errors.OpError, RuntimeError, ValueError, NotImplementedError) as e:  # XLA missing or failing
        return f"no: {type(e).__name__}: {(str(e).strip() or type(e).__name__).splitlines()[0][:200]}"
