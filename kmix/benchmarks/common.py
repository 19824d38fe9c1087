"""What the benchmarks share: timing, rounds, arguments, errors as rows, memory figures, fresh processes."""

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import subprocess
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix._output import format_table, progress  # noqa: F401  (re-exported for the benchmarks)
from kmix.route import facts
from kmix.route.timing import median, seconds  # noqa: F401  (median, compiled: re-exported for the benchmarks)
from kmix.route.trials import compiled  # noqa: F401

SIZE_HELP = {"layers": "transformer blocks", "d_model": "model width", "heads": "attention heads (divide --d-model)",
             "seq": "sequence length", "vocab": "vocabulary size", "batch": "batch size",
             "image": "ResNet50 / MobileNetV2: image side in pixels (>= 32)",
             "steps": "steps per timed (or traced) round", "rounds": "timed rounds", "batch_size": "rows of the batch"}
QUICK = dict(layers=1, d_model=16, heads=2, seq=16, batch=2, vocab=64, image=32, steps=2, rounds=1)


def bench_parser(name, doc, **kwargs):
    """The parser of `python -m kmix bench NAME`, described by `doc`'s first line."""
    return argparse.ArgumentParser(prog=f"python -m kmix bench {name}", description=doc.splitlines()[0], **kwargs)


def time_call(fn, repeats, warmup=1):
    """Runs `fn()` `warmup` times untimed, then `repeats` times; returns the seconds of each."""
    return [seconds(fn) for _ in range(warmup + repeats)][warmup:]


def alternate(fns, rounds, warmup=1, after_round=None, rotate=False, before=None):
    """`{name: [seconds, one per round]}`: each of `fns` timed once a round, in turn (`rotate`: from one further
    on), after `warmup` untimed calls before its first round, `before(name)` before each; `after_round(r, times)`."""
    times = {name: [] for name in fns}
    for r in range(rounds):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)] if rotate else list(fns)
        for name in order:
            if before is not None:
                before(name)
            times[name] += time_call(fns[name], 1, warmup if r == 0 else 0)
        if after_round is not None:
            after_round(r, times)
    return times


def steady(dataset):
    """`dataset` without tf.data's autotuning thread, whose wake-ups would snap short `fit` rounds to them."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def token_batch(rng, vocab, batch, seq, low=0):
    """`(x, next tokens)`: token ids in `[low, vocab)` and a full padding mask, as keras-hub models take them."""
    ids = rng.integers(low, vocab, (batch, seq + 1)).astype("int32")
    return {"token_ids": ids[:, :-1], "padding_mask": np.ones((batch, seq), "int32")}, ids[:, 1:]


@contextlib.contextmanager
def quiet_tf_logs():
    """TensorFlow's logger at ERROR inside the block: every route traces its own step (retracing notes)."""
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def gpu_device():
    """`"GPU:0"` where TensorFlow sees a GPU, else None."""
    return "GPU:0" if tf.config.list_physical_devices("GPU") else None


def allocator_device():
    """The device whose allocator the memory figures read: `"GPU:0"` if there is one, else `"CPU:0"`."""
    return gpu_device() or "CPU:0"


def device_label():
    """The first GPU's name, or `"CPU (<model>)"`."""
    gpus = facts.gpus()
    return gpus[0]["name"] if gpus else f"CPU ({kmix.device.cpu_features()['model']})"


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


def add_options(parser, **options):
    """An option `--NAME` per keyword (`no_jit` -> `--no-jit`): a flag for a help text, else `(default, help)`."""
    for name, option in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(option, str):
            parser.add_argument(flag, action="store_true", help=option)
        else:
            default, text = option
            shown = f"{default:g}" if isinstance(default, float) else default
            parser.add_argument(flag, type=type(default), default=default, help=f"{text}; default {shown}")


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
    return "n/a" if not n else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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


def peak_rss(reset=False):
    """This process's peak resident set in bytes since the last reset; `reset`: resets it to the current one."""
    if reset:  # Linux: clear_refs 5
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return rss("VmHWM")


def settled_rss():
    """The resident set once Python's garbage and malloc's free pages are returned."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss()


def cost_of(call):
    """`(seconds, extra peak resident bytes, kept resident bytes)` of `call()`."""
    base = settled_rss()
    peak_rss(reset=True)
    start = time.perf_counter()
    call()
    return time.perf_counter() - start, max(0, peak_rss() - base), settled_rss() - base


def save_plot(draw, path):
    """`draw(path)`, its folder made first; prints and returns the path it saved."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    path = draw(path)
    print(f"Plot saved to {os.path.abspath(path)}")
    return path


def host():
    """`"<processor>, <n> cores"`."""
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


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
