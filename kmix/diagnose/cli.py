"""`python -m kmix diagnose --demo`: the diagnosis of the demo's model with the hand-written -1e9 mask."""

import argparse
import os
import sys


def main(argv=None):
    """Runs the diagnosis, prints it and saves the PNG; returns the `kmix.Diagnosis`, its `plot_path` set.

    Args:
        argv: command-line arguments (`--help` lists them); `sys.argv` by default.
    """
    parser = argparse.ArgumentParser(prog="python -m kmix diagnose", description=(
        "Find why a float32 model would fail in half precision, before training: per-layer overflow and underflow, "
        "the first non-finite layer, the layers to keep in float32, the initial loss scale and the policy. In "
        "Python: kmix.diagnose(model, x, y)."))
    parser.add_argument("--demo", action="store_true", help="diagnose the demo's encoder (`python -m kmix demo`) "
                        "with the hand-written (1 - mask) * -1e9 attention mask")
    parser.add_argument("--policy", default="mixed_float16", help="the half policy to check (default mixed_float16)")
    parser.add_argument("--batches", type=int, default=4, help="batches of 32 sequences to run (default 4)")
    parser.add_argument("--out", default="kmix-out", help="folder for the PNG, created if missing (default ./kmix-out)")
    args = parser.parse_args(argv)
    if not args.demo:
        parser.error("the command line diagnoses the demo's model only (--demo); for your own model call "
                     "kmix.diagnose(model, x, y) in Python")
    if args.batches < 1:
        parser.error(f"--batches must be >= 1; received {args.batches}")
    import keras

    import kmix
    from kmix import demo

    with kmix.policy_scope("float32"):
        model = demo.build_model("naive")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
    x, y = demo.make_data(args.batches * demo.BATCH, seed=0)
    print(f"Diagnosing the demo's encoder (hand-written -1e9 mask) under {args.policy}: "
          f"{args.batches} batch(es) in float32, then in half precision...", file=sys.stderr, flush=True)
    diagnosis = kmix.diagnose(model, x, y, policy=args.policy, batches=args.batches, batch_size=demo.BATCH)
    print(diagnosis)
    os.makedirs(args.out, exist_ok=True)
    diagnosis.plot_path = diagnosis.plot(os.path.join(args.out, "diagnose.png"))
    print(f"\nGradient histogram and per-layer activations saved to {os.path.abspath(diagnosis.plot_path)}")
    return diagnosis
