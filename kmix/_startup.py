"""A quiet TensorFlow start for kmix's commands (`python -m kmix ...`, the `kmix` script); an import changes nothing.

TensorFlow prints its start-up notes from C++ before it reads `TF_CPP_MIN_LOG_LEVEL`, so a command sets the
variable (unless the user did) and starts TensorFlow with the C++ side of stderr captured: the notes are dropped,
anything else is written back, and where a driver is installed but no GPU is seen, its CUDA lines say why.
"""

import os
import re
import shutil
import sys
import tempfile

_LOG_LINE = re.compile(r"^(?P<level>[IWEF])\d{4} [\d:. ]+\d+ (?P<file>[\w.]+):\d+\]")
_ABSL_NOTE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_GPU_REASON = re.compile(r"cuda|cudnn|cublas|dlopen|dynamic librar|gpu_device|GPU will not be used", re.IGNORECASE)
DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"
_QUIET_LEVEL = "3"  # runtime notes logged at ERROR level too ("oneDNN supports DT_HALF only ..."); real errors raise


def launched_as_command(argv=None):
    """Whether this process is `python -m kmix ...` or the `kmix` console script."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[i + 1] in ("kmix", "kmix.__main__"):
            return True
    script = next((a for a in argv[1:] if not a.startswith("-")), "")
    return os.path.basename(script) == "kmix"


def quiet_tensorflow_start():
    """Sets `TF_CPP_MIN_LOG_LEVEL` and starts TensorFlow without its start-up notes.

    Returns:
        True when it did so; False when the user had set the variable (their level holds, nothing is
        filtered) or TensorFlow was already imported.
    """
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ or "tensorflow" in sys.modules:
        return False
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = _QUIET_LEVEL
    sys.stderr.flush()
    saved_fd = os.dup(2)
    python_stderr = sys.stderr
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            sys.stderr = os.fdopen(os.dup(saved_fd), "w", buffering=1)  # Python output goes through
            import tensorflow as tf

            devices = tf.config.list_physical_devices()  # the CUDA probe ("failed call to cuInit")
        finally:
            passing = sys.stderr
            passing.flush()
            sys.stderr = python_stderr
            _repoint_handlers(passing, python_stderr)
            passing.close()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
        captured.seek(0)
        driver = None if any(d.device_type == "GPU" for d in devices) else nvidia_driver()
        kept = drop_startup_notes(captured.read().decode("utf-8", "replace"), keep_gpu_reasons=driver is not None)
    if driver is not None:
        kept += (f"kmix: an NVIDIA driver is installed ({driver}) but TensorFlow sees no GPU. "
                 "`pip install \".[gpu]\"` brings the CUDA libraries TensorFlow needs (tensorflow[and-cuda]); "
                 "`python -m kmix bench gpu` prints TensorFlow's full reason.\n")
    if kept:
        sys.stderr.write(kept)
        sys.stderr.flush()
    return True


def _repoint_handlers(old, new):
    """Points the logging handlers made on `old` at `new`: TensorFlow's logger, made while the start was quiet,
    would otherwise write to a closed stream ("--- Logging error ---")."""
    import logging

    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):  # placeholders have none
            if isinstance(handler, logging.StreamHandler) and handler.stream is old:
                handler.setStream(new)


def nvidia_driver(version_file=DRIVER_VERSION_FILE):
    """The installed NVIDIA driver in a few words (`version_file`'s first line, `"nvidia-smi at <path>"`) or None."""
    try:
        with open(version_file, encoding="utf-8", errors="replace") as f:
            return " ".join(f.readline().split()) or "NVIDIA kernel module"
    except OSError:
        smi = shutil.which("nvidia-smi")
        return f"nvidia-smi at {smi}" if smi else None


def says_why_no_gpu(line):
    """Whether `line`, one of TensorFlow's C++ log lines, is about finding CUDA or a GPU."""
    match = _LOG_LINE.match(line)
    return bool(match) and (match["file"].startswith("cuda") or bool(_GPU_REASON.search(line)))


def drop_startup_notes(text, keep_gpu_reasons=False):
    """`text` (TensorFlow's C++ stderr) without its start-up notes: INFO and WARNING lines, CUDA probing.

    A log line's continuation lines go with it; `keep_gpu_reasons` keeps the lines about CUDA and GPUs.
    """
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        match = _LOG_LINE.match(line)
        if match:
            dropping = not (keep_gpu_reasons and says_why_no_gpu(line)) and (
                match["level"] in "IW" or match["file"].startswith("cuda"))
        elif line.rstrip("\n") == _ABSL_NOTE:
            dropping = True
            continue
        if not dropping:
            kept.append(line)
    return "".join(kept)
