"""`python -m kmix bench softmax`: error and time of kmix.layers.Softmax against keras.layers.Softmax.

Both run under `mixed_float16` on float16 scores `(batch, heads, T, T)` with a key-padding mask, eager and
under XLA; the error is against a float64 softmax, and runs alternate so that drift hits both.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix.benchmarks.common import alternate, format_table, median, progress

HEADERS = ["T", "mode", "keras err", "kmix err f32", "kmix err f16", "keras ms", "kmix ms", "kmix/keras"]


def make_inputs(length, batch, heads, seed=0):
    """Float16 scores `(batch, heads, T, T)`, a bool key mask `(batch, 1, 1, T)`, and the float64 softmax."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(scale=3.0, size=(batch, heads, length, length)).astype(np.float16)
    lengths = np.maximum(1, (length * rng.uniform(0.5, 1.0, size=batch)).astype(int))
    lengths[0] = length
    keep = (np.arange(length)[None, :] < lengths[:, None])[:, None, None, :]
    x = np.where(keep, scores.astype(np.float64), -np.inf)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return scores, keep, e / e.sum(axis=-1, keepdims=True)


def measure(length, batch, heads, repeats, jit_compile):
    """Returns one table row for sequence length `length`, eager or compiled."""
    scores, keep, expected = make_inputs(length, batch, heads)
    x, mask = tf.constant(scores), tf.constant(keep)
    layers = {"keras": keras.layers.Softmax(dtype="mixed_float16"), "kmix": kmix.layers.Softmax(dtype="mixed_float16"),
              "kmix_f32": kmix.layers.Softmax(dtype="mixed_float16", output_dtype="float32")}
    fns = {name: (lambda x, mask, layer=layer: layer(x, mask=mask)) for name, layer in layers.items()}
    if jit_compile:
        fns = {name: tf.function(fn, jit_compile=True) for name, fn in fns.items()}

    # Also compiles each once.
    errors = {name: float(np.max(np.abs(fn(x, mask).numpy().astype(np.float64) - expected)))
              for name, fn in fns.items()}
    # Fetching one element waits for the whole result (asynchronous devices).
    times = alternate({name: (lambda fn=fns[name]: fn(x, mask)[0, 0, 0, 0].numpy()) for name in ("keras", "kmix")},
                      repeats)
    ratios = [b / a for a, b in zip(times["keras"], times["kmix"])]
    return [length, "XLA" if jit_compile else "eager", errors["keras"], errors["kmix_f32"], errors["kmix"],
            median(times["keras"]) * 1e3, median(times["kmix"]) * 1e3, median(ratios)]


def main(argv=None):
    """Prints the error/time table; returns its rows, one per (length, mode), in `HEADERS` order."""
    parser = argparse.ArgumentParser(prog="python -m kmix bench softmax", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,256,512,1024",
                        help="comma-separated sequence lengths T; default 128,256,512,1024")
    parser.add_argument("--batch", type=int, default=2, help="batch size; default 2")
    parser.add_argument("--heads", type=int, default=4, help="attention heads; default 4")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per case; default 5")
    parser.add_argument("--no-jit", action="store_true", help="eager only, skip the XLA-compiled runs")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test (lengths 16,64)")
    args = parser.parse_args(argv)
    lengths = [16, 64] if args.quick else [int(t) for t in args.lengths.split(",") if t.strip()]
    batch, heads, repeats = (1, 2, 2) if args.quick else (args.batch, args.heads, args.repeats)
    modes = [False] if args.no_jit else [False, True]
    rows = []
    for length in lengths:
        for jit in modes:
            progress(f"[{len(rows) + 1}/{len(lengths) * len(modes)}] T={length} "
                     f"{'XLA' if jit else 'eager'}: {batch}x{heads}x{length}x{length} float16 scores")
            rows.append(measure(length, batch, heads, repeats, jit))
    print(f"mixed_float16 softmax over (batch={batch}, heads={heads}, T, T) with a key-padding mask; "
          "error = max |p - p_float64|")
    print(format_table(HEADERS, rows))
    return rows
