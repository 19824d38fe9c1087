"""What a call keeps once it returns, and whether anything of the model's is still held.

    python tools/kept_memory.py [--model qwen2-0.5b-lora] [--call autocast|export|recommend|predict|...]
                                [--repeat 2] [--budget 30] [--seq 64] [--batch-size 1]

Builds `kmix.benchmarks.scale`'s model in float32, then runs the call `--repeat` times in this process.
Each call is timed by `kmix.benchmarks.common.cost_of` (its extra peak and what it keeps, after `gc` and
`malloc_trim`), and the `tf.Variable`s and traced graphs (`FuncGraph`s) alive are counted before and after.
Prints one line per call: seconds, peak and kept memory as multiples of the float32 weights, the counts. Set
`TF_ONEDNN_USE_SYSTEM_ALLOCATOR=true` before the command to see past TensorFlow's oneDNN pool.
"""

import argparse
import gc
import os
import tempfile

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import func_graph  # the traced graphs' class: only counted here

from kmix.benchmarks import scale
from kmix.benchmarks.common import cost_of, token_batch


def alive():
    """`(tf.Variables alive, traced graphs alive)`, after a collection."""
    gc.collect()
    objects = gc.get_objects()
    return sum(isinstance(o, tf.Variable) for o in objects), sum(isinstance(o, func_graph.FuncGraph) for o in objects)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-0.5b-lora", choices=sorted(scale.MODELS))
    parser.add_argument("--call", default="export", choices=[c for c in scale.CALLS if c != "build"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--budget", type=float, default=30.0, help="recommend's budget_s")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    x, y = token_batch(rng, scale.MODELS[args.model][1]["vocabulary_size"], args.batch_size, args.seq, low=1)
    y = y if args.model.endswith("-lora") else rng.integers(0, 4, (args.batch_size,))  # the classifier's 4 classes
    model = scale.build(args.model)
    weights = sum(int(v.numpy().nbytes) for v in model.weights)
    if args.call in ("fit step", "recommend"):
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    print(f"{args.model}: {weights / 1e9:.2f} GB of float32 weights; TF_ONEDNN_USE_SYSTEM_ALLOCATOR="
          f"{os.environ.get('TF_ONEDNN_USE_SYSTEM_ALLOCATOR', '(unset)')}", flush=True)
    for i in range(args.repeat):
        before = alive()
        with tempfile.TemporaryDirectory() as tmp:
            seconds, extra, kept = cost_of(scale.calls_on(model, args.model, x, y, args.batch_size, args.budget,
                                                          tmp)[args.call])
        after = alive()
        print(f"{args.call} #{i + 1}: {seconds:.1f} s, extra peak {extra / weights:.3f}x and kept "
              f"{kept / weights:+.3f}x the weights; variables {before[0]} -> {after[0]}, traced graphs {before[1]} -> {after[1]}", flush=True)


if __name__ == "__main__":
    main()
