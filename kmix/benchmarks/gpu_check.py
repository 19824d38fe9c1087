"""Whether `bench gpu` has a GPU to measure and, where a driver is installed but none is seen, why."""

import importlib.metadata
import os
import subprocess
import sys

import tensorflow as tf

from kmix._startup import nvidia_driver, says_why_no_gpu  # noqa: F401  (re-exported)
from kmix.route import facts

NO_GPU = ("No GPU is visible to TensorFlow and no NVIDIA driver is installed, so `python -m kmix bench gpu` "
          "has nothing to measure here (it runs the checks that need a GPU). `python -m kmix doctor` "
          "describes this machine.")
FIX = ('`pip install ".[gpu]"` (tensorflow[and-cuda]: the CUDA runtime and cuDNN TensorFlow was built '
       "against), then run `python -m kmix bench gpu` again.")


def gpu_facts():
    """`(name, compute capability)` of the first GPU, or None without one."""
    gpus = facts.gpus()
    return (gpus[0]["name"], facts.capability(gpus[0]["compute_capability"])) if gpus else None


def tensorflow_gpu_log(timeout=180):
    """What a fresh TensorFlow logs while it looks for GPUs, every log level on (stdout and stderr)."""
    look = "import tensorflow as tf; print('GPUs seen:', len(tf.config.list_physical_devices('GPU')))"
    try:
        done = subprocess.run([sys.executable, "-c", look], env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0"},
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"(TensorFlow did not finish looking for GPUs within {timeout} s)"
    return done.stderr + done.stdout


def why_no_gpu(driver, log=None):
    """What `bench gpu` prints where `driver` is installed and no GPU is seen: build, packages, TensorFlow's log."""
    log, build = (tensorflow_gpu_log() if log is None else log), tf.sysconfig.get_build_info()
    built = (f"built with CUDA {build.get('cuda_version')} and cuDNN {build.get('cudnn_version')}"
             if build.get("is_cuda_build") else "built without CUDA (no GPU support in this TensorFlow)")
    packages = sorted({f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions()
                       if (d.metadata["Name"] or "").lower().startswith("nvidia-")})  # tensorflow[and-cuda]'s
    reasons = [line.rstrip() for line in log.splitlines() if says_why_no_gpu(line)]
    none = "none (tensorflow[and-cuda] brings nvidia-cudnn-cu12 and the rest)."
    lines = [f"An NVIDIA driver is installed ({driver}) but TensorFlow {tf.__version__} sees no GPU, so nothing was "
             "measured.", f"- TensorFlow: {built}.", f"- CUDA pip packages: {', '.join(packages) or none}",
             "- TensorFlow's reason, as it logs it (TF_CPP_MIN_LOG_LEVEL=0) while it looks for GPUs:"]
    lines += [f"    {line}" for line in reasons[-25:]] or ["    (no line about CUDA or a GPU; its whole log:)"] + [
        f"    {line}" for line in log.strip().splitlines()[-15:]]
    return "\n".join(lines + [f"The usual fix: {FIX}"])
