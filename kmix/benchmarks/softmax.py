"""`python -m kmix bench softmax`: error and time of kmix.layers.Softmax against keras.layers.Softmax."""

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix.benchmarks.common import add_options, alternate, bench_parser, format_table, median, progress

HEADERS = ["T", "mode", "keras err", "kmix err f32", "kmix err f16", "keras ms", "kmix ms", "kmix/keras"]


def measure(length, batch, heads, repeats, jit_compile):
    """One table row for sequence length `length`, eager or compiled, against a float64 softmax."""
    rng = np.random.default_rng(0)
    scores = rng.normal(scale=3.0, size=(batch, heads, length, length)).astype(np.float16)
    lengths = np.maximum(1, (length * rng.uniform(0.5, 1.0, size=batch)).astype(int))
    lengths[0] = length
    keep = (np.arange(length)[None, :] < lengths[:, None])[:, None, None, :]
    e = np.where(keep, scores.astype(np.float64), -np.inf)
    e = np.exp(e - e.max(axis=-1, keepdims=True))
    expected = e / e.sum(axis=-1, keepdims=True)
    x, mask = tf.constant(scores), tf.constant(keep)
    layers = {"keras": keras.layers.Softmax(dtype="mixed_float16"), "kmix": kmix.layers.Softmax(dtype="mixed_float16"),
              "kmix_f32": kmix.layers.Softmax(dtype="mixed_float16", output_dtype="float32")}
    fns = {name: (lambda x, mask, layer=layer: layer(x, mask=mask)) for name, layer in layers.items()}
    fns = {name: tf.function(fn, jit_compile=True) for name, fn in fns.items()} if jit_compile else fns
    errors = {name: float(np.max(np.abs(fn(x, mask).numpy().astype(np.float64) - expected)))  # compiles each
              for name, fn in fns.items()}
    # Fetching one element waits for the whole result (asynchronous devices).
    times = alternate({name: (lambda fn=fns[name]: fn(x, mask)[0, 0, 0, 0].numpy()) for name in ("keras", "kmix")},
                      repeats)
    ratios = [b / a for a, b in zip(times["keras"], times["kmix"])]
    return [length, "XLA" if jit_compile else "eager", errors["keras"], errors["kmix_f32"], errors["kmix"],
            median(times["keras"]) * 1e3, median(times["kmix"]) * 1e3, median(ratios)]


def main(argv=None):
    """Prints the error/time table; returns its rows, one per (length, mode), in `HEADERS` order."""
    parser = bench_parser("softmax", __doc__)
    add_options(parser, lengths=("128,256,512,1024", "comma-separated sequence lengths T"), batch=(2, "batch size"),
                heads=(4, "attention heads"), repeats=(5, "timed rounds per case"),
                no_jit="eager only, skip the XLA-compiled runs", quick="tiny sizes for a smoke test (lengths 16,64)")
    args = parser.parse_args(argv)
    lengths = [16, 64] if args.quick else [int(t) for t in args.lengths.split(",") if t.strip()]
    batch, heads, repeats = (1, 2, 2) if args.quick else (args.batch, args.heads, args.repeats)
    modes, rows = ([False] if args.no_jit else [False, True]), []
    for length in lengths:
        for jit in modes:
            progress(f"[{len(rows) + 1}/{len(lengths) * len(modes)}] T={length} "
                     f"{'XLA' if jit else 'eager'}: {batch}x{heads}x{length}x{length} float16 scores")
            rows.append(measure(length, batch, heads, repeats, jit))
    print(f"mixed_float16 softmax over (batch={batch}, heads={heads}, T, T) with a key-padding mask; "
          f"error = max |p - p_float64|\n{format_table(HEADERS, rows)}")
    return rows
