"""`python -m kmix doctor`: versions, devices, tensor-core support and the policy to use.

The facts are gathered by `gather_facts()`; the advice comes from
`recommend_policy(compute_capabilities)`, a pure function of the GPUs'
compute capabilities, so every branch can be tested without the hardware:

- compute capability 8.0 or later (A100, RTX 30xx, L4, H100, H200, B200):
  `mixed_bfloat16`. bfloat16 tensor cores run as fast as float16 ones, and
  bfloat16 has float32's range: no loss scaling, no overflow.
- 7.x (V100, T4, RTX 20xx): `mixed_float16` with `kmix.wrap`: float16 tensor
  cores, no bfloat16 ones; float16 needs loss scaling.
- below 7.0: `float32`: no tensor cores, so half precision saves memory but
  little or no time.
- no GPU: `float32`: a CPU has no tensor cores and runs most float16 math
  slower than float32.

With several GPUs the oldest one decides: every replica runs the same policy.
"""

import argparse
import dataclasses
import os
import platform
import sys

FLOAT16_TENSOR_CORES = (7, 0)  # Volta
BFLOAT16_TENSOR_CORES = (8, 0)  # Ampere


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The policy `doctor` recommends.

    Attributes:
        policy: a Keras / kmix policy name: `"mixed_bfloat16"`,
            `"mixed_float16"` or `"float32"`.
        reason: one or two sentences saying why, naming the device facts.
        loss_scaling: whether the policy needs `kmix.wrap`'s dynamic loss scale.
    """

    policy: str
    reason: str
    loss_scaling: bool


def tensor_cores(compute_capability):
    """Which half-precision dtypes have tensor cores at `compute_capability`.

    Args:
        compute_capability: `(major, minor)`, or None when unknown (no GPU).

    Returns:
        `{"float16": bool, "bfloat16": bool}`.

    Example:
        >>> tensor_cores((7, 5))
        {'float16': True, 'bfloat16': False}
    """
    if compute_capability is None:
        return {"float16": False, "bfloat16": False}
    cc = tuple(compute_capability)
    return {"float16": cc >= FLOAT16_TENSOR_CORES, "bfloat16": cc >= BFLOAT16_TENSOR_CORES}


def recommend_policy(compute_capabilities):
    """The policy to train with, given the GPUs' compute capabilities.

    Args:
        compute_capabilities: one entry per GPU, each `(major, minor)` or None
            when the GPU does not report it; an empty list when there is no GPU.

    Returns:
        A `Recommendation`.

    Example:
        >>> recommend_policy([(9, 0)]).policy
        'mixed_bfloat16'
        >>> recommend_policy([]).policy
        'float32'
    """
    ccs = [None if cc is None else tuple(cc) for cc in compute_capabilities]
    if not ccs:
        return Recommendation(
            "float32",
            "No GPU found. A CPU has no tensor cores and runs most float16 math slower than "
            "float32, so mixed precision would cost time; train in float32 here and use "
            "mixed precision on a GPU.",
            loss_scaling=False,
        )
    if any(cc is None for cc in ccs):
        return Recommendation(
            "float32",
            "A GPU did not report its compute capability, so its tensor cores are unknown. "
            "Compare the policies with `python -m kmix bench train` before choosing one.",
            loss_scaling=False,
        )
    oldest = min(ccs)
    shown = f"{oldest[0]}.{oldest[1]}"
    several = " (the oldest of the GPUs decides)" if len(set(ccs)) > 1 else ""
    if oldest >= BFLOAT16_TENSOR_CORES:
        return Recommendation(
            "mixed_bfloat16",
            f"Compute capability {shown}{several} has bfloat16 tensor cores, as fast as float16's; "
            "bfloat16 has float32's range, so no loss scaling and no overflow. kmix.wrap keeps "
            "a fixed scale of 1 and still skips non-finite steps.",
            loss_scaling=False,
        )
    if oldest >= FLOAT16_TENSOR_CORES:
        return Recommendation(
            "mixed_float16",
            f"Compute capability {shown}{several} has float16 tensor cores but none for bfloat16 "
            "(from 8.0). float16 needs loss scaling: compile with kmix.wrap(optimizer) and keep "
            "softmax and masks in float32 (kmix.layers).",
            loss_scaling=True,
        )
    return Recommendation(
        "float32",
        f"Compute capability {shown}{several} has no tensor cores (from 7.0): half precision "
        "would save memory but little or no time. Use mixed_float16 with kmix.wrap only when "
        "memory is what runs out.",
        loss_scaling=False,
    )


def gather_facts():
    """Versions, devices and capabilities of this machine, as a dict.

    Returns:
        A dict with `versions` (name -> version string), `gpus` (one dict per
        GPU: `name`, `compute_capability` or None), `cpu` (architecture and
        cores), `built_with_cuda`, `cuda` / `cudnn` build versions (or
        None), `tf32` (whether TensorFlow's TF32 setting is on; it acts only on
        GPUs of compute capability 8.0+), `xla` (a string: "yes" or why
        not), `cuda_visible_devices` (the variable, or None when unset) and
        `nvidia_driver` (the driver's version line, or None).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import kmix

    versions = {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "kmix": kmix.__version__,
    }
    gpus = []
    for device in tf.config.list_physical_devices("GPU"):
        try:
            details = tf.config.experimental.get_device_details(device)
        except (ValueError, RuntimeError):
            details = {}
        gpus.append({
            "name": details.get("device_name", device.name),
            "compute_capability": details.get("compute_capability"),
        })
    build = tf.sysconfig.get_build_info()
    return {
        "versions": versions,
        "gpus": gpus,
        "cpu": f"{platform.machine() or 'unknown'}, {os.cpu_count() or '?'} core(s)",
        "built_with_cuda": tf.test.is_built_with_cuda(),
        "cuda": build.get("cuda_version"),
        "cudnn": build.get("cudnn_version"),
        "tf32": tf.config.experimental.tensor_float_32_execution_enabled(),
        "xla": _check_xla(tf),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "nvidia_driver": _nvidia_driver(),
    }


def _nvidia_driver():
    """The NVIDIA kernel driver's version line, or None when no driver is loaded (Linux)."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip() or None
    except OSError:
        return None


def tf32_line(facts):
    """What the report says about TF32: only meaningful with a GPU of compute capability 8.0+.

    Args:
        facts: the dict of `gather_facts()` (`gpus`, `tf32`).

    Returns:
        One line of text.

    Example:
        >>> tf32_line({"gpus": [], "tf32": True})
        'not applicable (no GPU; TF32 is a tensor-core mode of compute capability 8.0+)'
    """
    ccs = [gpu["compute_capability"] for gpu in facts["gpus"]]
    if not ccs:
        return "not applicable (no GPU; TF32 is a tensor-core mode of compute capability 8.0+)"
    capable = [i for i, cc in enumerate(ccs) if cc is not None and tensor_cores(cc)["bfloat16"]]
    if not capable:
        return "not applicable (no GPU of compute capability 8.0+, which TF32 needs)"
    which = "every GPU" if len(capable) == len(ccs) else "GPU " + ", ".join(str(i) for i in capable)
    if facts["tf32"]:
        return f"enabled on {which} (float32 matmuls and convolutions run on tensor cores)"
    return (f"disabled (float32 matmuls in full float32 on {which}; "
            "tf.config.experimental.enable_tensor_float_32_execution(True) turns it on)")


def why_no_gpu(facts):
    """Why a CUDA build of TensorFlow sees no GPU, as far as the facts tell; None otherwise.

    Args:
        facts: the dict of `gather_facts()`.

    Returns:
        A sentence, or None when there is a GPU or TensorFlow is not a CUDA build.
    """
    if facts["gpus"] or not facts["built_with_cuda"]:
        return None
    visible = facts.get("cuda_visible_devices")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return (f"TensorFlow is a CUDA build but sees no GPU: CUDA_VISIBLE_DEVICES is set to "
                f"{visible!r}, which hides every GPU. Unset it, or list the GPUs (e.g. 0).")
    if facts.get("nvidia_driver") is None:
        return ("TensorFlow is a CUDA build but sees no GPU: no NVIDIA driver is loaded "
                "(/proc/driver/nvidia/version is missing): a machine without a GPU, or a "
                "container started without GPU access (docker --gpus all).")
    shown = "" if visible is None else f" CUDA_VISIBLE_DEVICES={visible!r} may hide them."
    return ("TensorFlow is a CUDA build and an NVIDIA driver is loaded, but TensorFlow sees no "
            "GPU: the driver may be older than the CUDA libraries TensorFlow needs, or they may "
            f"be missing (pip install tensorflow[and-cuda]); TensorFlow's log says which.{shown}")


def _check_xla(tf):
    """Compiles and runs a tiny function with XLA; "yes" or the reason it failed."""
    try:
        fn = tf.function(lambda x: tf.reduce_sum(tf.matmul(x, x)), jit_compile=True)
        float(fn(tf.ones((4, 4))))
        return "yes (a jit_compile=True function compiled and ran)"
    except Exception as e:  # noqa: BLE001  XLA failures come as many error types
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"no: {type(e).__name__}: {first_line[:200]}"


def format_report(facts, recommendation):
    """The doctor's report as text."""
    lines = ["Versions"]
    lines += [f"  {name:<11} {version}" for name, version in facts["versions"].items()]
    lines.append("Devices")
    lines.append(f"  {'CPU':<11} {facts['cpu']}")
    cuda = "yes" if facts["built_with_cuda"] else "no"
    if facts["built_with_cuda"]:
        cuda += f" (CUDA {facts['cuda'] or '?'}, cuDNN {facts['cudnn'] or '?'})"
    lines.append(f"  {'CUDA build':<11} {cuda}")
    if not facts["gpus"]:
        lines.append(f"  {'GPU':<11} none found")
    for i, gpu in enumerate(facts["gpus"]):
        cc = gpu["compute_capability"]
        cores = tensor_cores(cc)
        lines.append(f"  GPU {i:<7} {gpu['name']}")
        lines.append(f"    compute capability      {'unknown' if cc is None else f'{cc[0]}.{cc[1]}'}")
        lines.append(f"    float16 tensor cores    {_yes(cores['float16'])}")
        lines.append(f"    bfloat16 tensor cores   {_yes(cores['bfloat16'])}")
    if not facts["gpus"]:
        lines.append(f"  {'':<11} float16 tensor cores: no; bfloat16 tensor cores: no (no GPU)")
        reason = why_no_gpu(facts)
        if reason:
            lines.append(f"  {'':<11} {reason}")
    lines.append("Compilation")
    lines.append(f"  {'XLA':<11} {facts['xla']}")
    lines.append(f"  {'TF32':<11} {tf32_line(facts)}")
    lines.append("Recommended policy")
    lines.append(f"  {recommendation.policy}")
    lines.append(f"  {recommendation.reason}")
    if recommendation.policy != "float32":
        wrap = "kmix.wrap(optimizer)" + ("  # dynamic loss scale" if recommendation.loss_scaling else "")
        lines.append(f"  kmix.set_policy({recommendation.policy!r}); model.compile(optimizer={wrap}, ...)")
    return "\n".join(lines)


def _yes(flag):
    return "yes" if flag else "no"


def main(argv=None):
    """Prints the report; returns `{"facts": ..., "recommendation": ...}`."""
    parser = argparse.ArgumentParser(
        prog="python -m kmix doctor",
        description="Print versions, devices, compute capability, float16/bfloat16 tensor-core "
        "support, XLA availability and the recommended mixed-precision policy.",
    )
    parser.parse_args(argv)
    facts = gather_facts()
    recommendation = recommend_policy([gpu["compute_capability"] for gpu in facts["gpus"]])
    print(format_report(facts, recommendation))
    sys.stdout.flush()
    return {"facts": facts, "recommendation": recommendation}
