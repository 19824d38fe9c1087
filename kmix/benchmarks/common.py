"""What the benchmarks share: timing, rounds, arguments, errors as rows, memory figures, fresh processes."""

import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import keras
import tensorflow as tf

import kmix
from kmix._output import format_table, progress  # noqa: F401  (re-exported for the benchmarks)

SIZE_HELP = {"layers": "transformer blocks", "d_model": "model width", "heads": "attention heads (divide --d-model)",
             "seq": "sequence length", "vocab": "vocabulary size", "batch": "batch size",
             "image": "ResNet50 / MobileNetV2: image side in pixels (>= 32)",
             "steps": "steps per timed (or traced) round", "rounds": "timed rounds"}
QUICK = dict(layers=1, d_model=16, heads=2, seq=16, batch=2, vocab=64, image=32, steps=2, rounds=1)
median = statistics.median


def time_call(fn, repeats, warmup=1):
    """Runs `fn()` `warmup` times untimed, then `repeats` times; returns the seconds of each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def alternate(fns, rounds, warmup=1, after_round=None, rotate=False):
    """`{name: [seconds, one per round]}`: each of `fns` timed once a round, in turn, so that drift hits all alike.

    Each gets `warmup` untimed calls before its first round; `after_round(r, times)` is called after each
    round; with `rotate`, each round starts one further along.
    """
    times = {name: [] for name in fns}
    for r in range(rounds):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)] if rotate else list(fns)
        for name in order:
            times[name] += time_call(fns[name], 1, warmup if r == 0 else 0)
        if after_round is not None:
            after_round(r, times)
    return times


def steady(dataset):
    """`dataset` without tf.data's autotuning thread, whose wake-ups would snap short `fit` rounds to them."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


@contextlib.contextmanager
def quiet_tf_logs():
    """TensorFlow's logger at ERROR inside the block: every route traces its own step (retracing notes)."""
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def gpu_device():
    """`"GPU:0"` where TensorFlow sees a GPU, else None."""
    return "GPU:0" if tf.config.list_physical_devices("GPU") else None


def device_label():
    """The first GPU's name, or `"CPU (<model>)"`."""
    if gpu_device():
        return tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0]).get(
            "device_name", "GPU")
    return f"CPU ({kmix.device.cpu_features()['model']})"


def recommend_here(quick=False):
    """`kmix.recommend()` on this device, after a progress line; `quick`: a tiny probe."""
    progress("kmix.recommend(): probing this device")
    return kmix.recommend(probe=kmix.device.probe((64, 16, 32), budget=0.02) if quick else None)


def fresh_session():
    """Clears Keras's session and collects Python's garbage, so that a route's memory is its own."""
    keras.backend.clear_session()
    gc.collect()


def allocator_peak(device, reset=False):
    """The allocator's peak bytes on `device` (resets it with `reset`); None where it keeps no statistics."""
    try:
        if reset:
            return tf.config.experimental.reset_memory_stats(device)
        return tf.config.experimental.get_memory_info(device)["peak"]
    except (ValueError, tf.errors.InvalidArgumentError):  # a CPU allocator without statistics
        return None


def measured(fn, **head):
    """`fn()`, or `{**head, "error": "Type: message"}` where it raised, so that a failure ends only its row."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001  out of memory, a failed compile or trace: the row says which
        lines = str(error).strip().splitlines()
        text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        return {**head, "error": text if len(text) <= 300 else text[:297] + "..."}


def add_size_arguments(parser, **defaults):
    """Adds an int option `--NAME` per keyword (`d_model` -> `--d-model`) with the shared help."""
    for name, default in defaults.items():
        shown = "" if default is None else f"; default {default}"
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default, help=SIZE_HELP[name] + shown)


def check_sizes(parser, args, quick=QUICK):
    """Applies `quick` under `--quick`, then checks the size options; returns the model's `{name: value}`."""
    names = [n for n in SIZE_HELP if hasattr(args, n)]
    for name in names:
        if getattr(args, "quick", False) and name in quick:
            setattr(args, name, quick[name])
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; received {getattr(args, name)}")
    if hasattr(args, "heads") and args.d_model % args.heads:
        parser.error(f"--heads must divide --d-model; received --d-model {args.d_model} --heads {args.heads}")
    if getattr(args, "image", 32) < 32:
        parser.error(f"--image must be >= 32 (ResNet50's smallest input); received {args.image}")
    return {n: getattr(args, n) for n in names if n not in ("steps", "rounds")}


def choices(parser, option, text, known):
    """The comma-separated names of `text`, each one of `known`; a usage error otherwise."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or set(names) - set(known):
        parser.error(f"{option} accepts {', '.join(known)}; received {text!r}")
    return names


def format_bytes(n):
    """`"1.00 GiB"`, `"512.0 MiB"`; `"n/a"` for None or 0."""
    if not n:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def ratio_bars(panels, path, title):
    """Saves one panel of horizontal bars per `(names, ratios, label)`, 1.0 marked, as a PNG; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4.8), squeeze=False)
    for ax, (names, values, label) in zip(axes[0], panels):
        values = [v if isinstance(v, float) else 0.0 for v in values]
        ax.set_title(label, fontsize=9)
        if not values:
            ax.text(0.5, 0.5, "not run", ha="center", va="center")
            continue
        ax.bar_label(ax.barh(range(len(names)), values, color="tab:blue"), fmt="%.2f", fontsize=8)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set(xlim=(0, max(values) * 1.2 or 1.0))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def rss(field="VmRSS"):
    """This process's resident set in bytes (`"VmHWM"`: its peak); 0 where not Linux."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), 0)
    except OSError:
        return 0


def peak_rss():
    """This process's peak resident set since the last `reset_peak_rss`, in bytes."""
    return rss("VmHWM")


def reset_peak_rss():
    """Resets the peak resident set to the current one (Linux: `clear_refs` 5)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def settled_rss():
    """The resident set once Python's garbage and malloc's free pages are returned."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss()


def kept_by(call):
    """The resident set `call()` leaves behind, in bytes."""
    base = settled_rss()
    call()
    return settled_rss() - base


def in_fresh_process(module, function, kwargs):
    """`module.function(**kwargs)` in a fresh Python process; its JSON result, or a RuntimeError with its log."""
    code = (f"import json, sys; from {module} import {function}; "
            f"print('KMIX-RESULT ' + json.dumps({function}(**json.loads(sys.argv[1]))), flush=True)")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True, env=env)
    found = [line for line in done.stdout.splitlines() if line.startswith("KMIX-RESULT ")]
    if not found:
        raise RuntimeError(f"{function} failed in its process (exit status {done.returncode}):\n"
                           f"{done.stderr[-3000:] or 'no output'}")
    return json.loads(found[-1][len("KMIX-RESULT "):])
