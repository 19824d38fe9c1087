"""`python -m kmix bench softmax`: error and time of kmix.layers.Softmax against keras.layers.Softmax.

Both layers run under `mixed_float16` on float16 attention scores
`(batch, heads, T, T)` with a key-padding mask, eager and compiled with XLA.
The error is the largest absolute difference from a float64 softmax of the same
float16 scores: for kmix with `output_dtype="float32"` (the target is <= 1e-6)
and as the drop-in with float16 output (then float16 rounding dominates).
Times are for the drop-in (float16 in, float16 out) against Keras's float16
softmax; runs alternate between the two so drift on a shared machine hits both,
and the ratio is the median of the per-round ratios. On a CPU float16 math is
emulated and only the ratio means anything; the speed target is on a GPU.
"""

import argparse

import numpy as np

from kmix.benchmarks.common import format_table, median, progress, time_call

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
    import keras
    import tensorflow as tf

    import kmix

    scores, keep, expected = make_inputs(length, batch, heads)
    x, mask = tf.constant(scores), tf.constant(keep)
    layers = {
        "keras": keras.layers.Softmax(dtype="mixed_float16"),
        "kmix": kmix.layers.Softmax(dtype="mixed_float16"),
        "kmix_f32": kmix.layers.Softmax(dtype="mixed_float16", output_dtype="float32"),
    }
    fns = {}
    for name, layer in layers.items():
        fn = (lambda layer: lambda x, mask: layer(x, mask=mask))(layer)
        fns[name] = tf.function(fn, jit_compile=True) if jit_compile else fn

    def error(name):
        got = fns[name](x, mask).numpy().astype(np.float64)
        return float(np.max(np.abs(got - expected)))

    errors = {name: error(name) for name in fns}  # also compiles each once

    def run(name):
        # Fetching one element waits for the whole result (asynchronous devices).
        return lambda: fns[name](x, mask)[0, 0, 0, 0].numpy()

    times = {"keras": [], "kmix": []}
    for r in range(repeats):
        for name in times:
            times[name].append(time_call(run(name), repeats=1, warmup=1 if r == 0 else 0)[0])
    ratios = [b / a for a, b in zip(times["keras"], times["kmix"])]
    return [
        length,
        "XLA" if jit_compile else "eager",
        errors["keras"],
        errors["kmix_f32"],
        errors["kmix"],
        median(times["keras"]) * 1e3,
        median(times["kmix"]) * 1e3,
        median(ratios),
    ]


def main(argv=None):
    """Prints the error/time table of kmix.layers.Softmax vs keras.layers.Softmax.

    Args:
        argv: command-line arguments (`--help` lists them); `sys.argv` by default.

    Returns:
        The table's rows, one list per (length, mode), in `HEADERS` order.

    Example:
        >>> from kmix.benchmarks import softmax
        >>> rows = softmax.main(["--quick"])
    """
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
    for i, length in enumerate(lengths):
        for jit in modes:
            progress(f"[{len(rows) + 1}/{len(lengths) * len(modes)}] T={length} "
                     f"{'XLA' if jit else 'eager'}: {batch}x{heads}x{length}x{length} float16 scores")
            rows.append(measure(length, batch, heads, repeats, jit))
    print(f"mixed_float16 softmax over (batch={batch}, heads={heads}, T, T) with a key-padding mask; "
          "error = max |p - p_float64|")
    print(format_table(HEADERS, rows))
    return rows


if __name__ == "__main__":
    main()
