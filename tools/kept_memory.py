"""What a call keeps once it returns, and whether anything of the model's is still held.

    python tools/kept_memory.py [--model qwen2-0.5b-lora] [--call autocast|export|model.export|recommend|predict]
                                [--repeat 2] [--budget 30] [--seq 64] [--batch-size 1]

Builds `kmix.benchmarks.scale`'s model in float32, then runs the call `--repeat` times in this process.
Before and after each: `gc.collect()` and glibc's `malloc_trim(0)`, the resident set, and a census of
the `tf.Variable`s and traced graphs (`FuncGraph`s) alive. Prints one line per call: seconds, resident
memory kept as a multiple of the float32 weights, and the census before -> after. Set
`TF_ONEDNN_USE_SYSTEM_ALLOCATOR=true` before the command to see past TensorFlow's oneDNN pool.
"""

import argparse
import ctypes
import gc
import os
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import func_graph  # the traced graphs' class: only counted here

import kmix
from kmix.benchmarks import scale
from kmix.benchmarks.common import rss, token_batch


def settled():
    """`(resident bytes, variables alive, traced graphs alive)` after a collection and a trim."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    objects = gc.get_objects()
    return (rss(), sum(isinstance(o, tf.Variable) for o in objects),
            sum(isinstance(o, func_graph.FuncGraph) for o in objects))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-0.5b-lora", choices=sorted(scale.MODELS))
    parser.add_argument("--call", default="export", choices=["autocast", "export", "model.export", "recommend",
                                                               "predict"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--budget", type=float, default=30.0, help="recommend's budget_s")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args(argv)
    x, y = token_batch(np.random.default_rng(0), scale.MODELS[args.model][1]["vocabulary_size"],
                       args.batch_size, args.seq, low=1)
    model = scale.build(args.model)
    if not args.model.endswith("-lora"):
        y = np.random.default_rng(0).integers(0, 4, (args.batch_size,))  # the classifier's 4 classes
    weights = sum(int(v.numpy().nbytes) for v in model.weights)
    if args.call == "recommend":
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    calls = {"autocast": lambda to: kmix.autocast(model, "O1-bfloat16"),
             "export": lambda to: kmix.export(model, os.path.join(to, "kmix"), sample=x, verbose=False),
             "model.export": lambda to: model.export(os.path.join(to, "keras"), format="tf_saved_model",
                                                     verbose=False),
             "recommend": lambda to: kmix.recommend(model, x, y, batch_size=args.batch_size, budget_s=args.budget,
                                                    verbose=False),
             "predict": lambda to: model.predict(x, verbose=0)}
    print(f"{args.model}: {weights / 1e9:.2f} GB of float32 weights; TF_ONEDNN_USE_SYSTEM_ALLOCATOR="
          f"{os.environ.get('TF_ONEDNN_USE_SYSTEM_ALLOCATOR', '(unset)')}", flush=True)
    for i in range(args.repeat):
        before = settled()
        with tempfile.TemporaryDirectory() as to:
            start = time.perf_counter()
            calls[args.call](to)
            seconds = time.perf_counter() - start
        after = settled()
        print(f"{args.call} #{i + 1}: {seconds:.1f} s, kept {(after[0] - before[0]) / weights:+.3f}x the weights; "
              f"variables {before[1]} -> {after[1]}, traced graphs {before[2]} -> {after[2]}", flush=True)


if __name__ == "__main__":
    main()
