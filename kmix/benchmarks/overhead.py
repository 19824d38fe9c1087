"""`python -m kmix bench overhead`: step time of kmix against Keras's LossScaleOptimizer.

A compiled model with many small variables makes the per-variable work of a
loss-scale optimizer (finite checks, unscaling, counters) as visible as it
can be. Both optimizers train the same model on the same data; runs alternate
(A, B, A, B, ...) so that drift on a shared machine hits both, and the
reported ratio is that of the fastest round of each (the least disturbed
estimate on a busy machine), with the median ratio of the rounds beside it.
A last row times `optimizer.apply` alone on the same variables: the part
kmix changes, free of the forward and backward passes' noise.
"""

import argparse

import numpy as np

from kmix.benchmarks.common import format_table, median, progress, time_call


def build_and_compile(kind, layers, width, jit_compile, seed=0, batchnorm=False, restore=True):
    """A `layers`-deep stack of `Dense(width)` under mixed_float16, compiled with `kind`'s optimizer.

    `batchnorm` puts a `BatchNormalization` after each Dense (2 non-trainable
    variables each, which kmix guards against skipped steps unless `restore`
    is False).
    """
    import keras

    import kmix

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((width,))]
        + [layer for _ in range(layers) for layer in (
            [keras.layers.Dense(width, activation="relu")]
            + ([keras.layers.BatchNormalization()] if batchnorm else []))]
        + [keras.layers.Dense(1, dtype="float32")]
    )
    inner = keras.optimizers.Adam(1e-4)
    # Keras's own Adam arithmetic in both (not kmix's fused kernel): what is timed is the
    # loss-scale machinery alone, and the two must end with the same weights, bit for bit.
    opt = (keras.optimizers.LossScaleOptimizer(inner) if kind == "keras"
           else kmix.wrap(inner, restore_on_skip=restore, fused_update=False))
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    return model


def measure(layers=64, width=16, batch=32, steps=200, rounds=5, jit_compile=False, batchnorm=False,
            restore=True):
    """Times both optimizers on the same training.

    Returns:
        `(per_step, same_weights)`: `{kind: [seconds per step, one per round]}`
        for "keras" and "kmix", and whether the two models ended with
        bit-identical weights (they should: with Keras's defaults kmix takes
        the same steps), which shows both timed the same work.
    """
    import kmix

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, width)).astype("float32")
    y = rng.normal(size=(batch * steps, 1)).astype("float32")
    with kmix.policy_scope("mixed_float16"):
        models = {kind: build_and_compile(kind, layers, width, jit_compile, batchnorm=batchnorm, restore=restore)
                  for kind in ("keras", "kmix")}
    per_step = {kind: [] for kind in models}
    for r in range(rounds):
        for kind, model in models.items():
            seconds = time_call(
                lambda: model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0),
                repeats=1,
                warmup=1 if r == 0 else 0,
            )[0]
            per_step[kind].append(seconds / steps)
        progress(f"round {r + 1}/{rounds}: keras {per_step['keras'][-1] * 1e3:.3f} ms/step, "
                 f"kmix {per_step['kmix'][-1] * 1e3:.3f} ms/step")
    same_weights = all(
        np.array_equal(a, b)
        for a, b in zip(models["keras"].get_weights(), models["kmix"].get_weights())
    )
    return per_step, same_weights


def measure_apply(layers=64, width=16, steps=200, rounds=5):
    """Times `optimizer.apply` alone, in a `tf.function`, on the same variables as `measure`.

    The part of a step that kmix changes, without the forward and backward
    passes whose run-to-run noise on a shared CPU is larger than the
    difference being measured.

    Returns:
        `{kind: [seconds per apply, one per round]}` for "keras" and "kmix".
    """
    import keras
    import tensorflow as tf

    import kmix

    shapes = [(width, width), (width,)] * layers + [(width, 1), (1,)]
    variables = [keras.Variable(np.ones(s, np.float32)) for s in shapes]
    grads = [tf.ones(s) for s in shapes]
    applies = {}
    for kind in ("keras", "kmix"):
        inner = keras.optimizers.Adam(1e-4)
        opt = keras.optimizers.LossScaleOptimizer(inner) if kind == "keras" else kmix.wrap(
            inner, dynamic=True, initial_scale=2.0**15
        )
        opt.build(variables)
        # The gradients stand for those of a scaled loss; kmix is told so (no scale_loss here).
        extra = {"scaled": True} if kind == "kmix" else {}
        applies[kind] = tf.function(lambda opt=opt, extra=extra: opt.apply(grads, variables, **extra))
    per_apply = {kind: [] for kind in applies}
    for r in range(rounds):
        for kind, fn in applies.items():
            per_apply[kind].append(time_call(fn, repeats=steps, warmup=1 if r == 0 else 0))
    return {kind: [sum(t) / steps for t in times] for kind, times in per_apply.items()}


def main(argv=None):
    """Prints the kmix / Keras step-time ratio table.

    Args:
        argv: command-line arguments (`--help` lists them); `sys.argv` by default.

    Returns:
        The table's rows: compiled mode, Keras and kmix ms/step (fastest
        round), their ratio, the median per-round ratio, and whether both
        models ended with the same weights; a last row times
        `optimizer.apply` alone.
    """
    parser = argparse.ArgumentParser(prog="python -m kmix bench overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=64, help="Dense layers (2 variables each); default 64")
    parser.add_argument("--width", type=int, default=16, help="units per layer; default 16")
    parser.add_argument("--batch", type=int, default=32, help="batch size; default 32")
    parser.add_argument("--steps", type=int, default=200, help="steps per timed round; default 200")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; default 5")
    parser.add_argument("--no-jit", action="store_true", help="only tf.function, skip the XLA-compiled run")
    parser.add_argument("--batchnorm", action="store_true",
                        help="a BatchNormalization after each Dense: the cost of restoring skipped steps' state")
    parser.add_argument("--no-restore", action="store_true",
                        help="kmix with restore_on_skip=False (Keras's behaviour for non-trainable state)")
    args = parser.parse_args(argv)
    rows = []
    for jit in ([False] if args.no_jit else [False, True]):
        label = "XLA" if jit else "tf.function"
        progress(f"{label}: {args.layers} layers x {args.width} units, {2 * args.layers + 2} variables")
        per_step, same = measure(args.layers, args.width, args.batch, args.steps, args.rounds, jit,
                                 args.batchnorm, not args.no_restore)
        ratios = [b / a for a, b in zip(per_step["keras"], per_step["kmix"])]
        best_keras, best_kmix = min(per_step["keras"]), min(per_step["kmix"])
        rows.append([label, best_keras * 1e3, best_kmix * 1e3, best_kmix / best_keras, median(ratios),
                     "yes" if same else "NO"])
    progress("optimizer.apply alone, in a tf.function")
    per_apply = measure_apply(args.layers, args.width, args.steps, args.rounds)
    ratios = [b / a for a, b in zip(per_apply["keras"], per_apply["kmix"])]
    best_keras, best_kmix = min(per_apply["keras"]), min(per_apply["kmix"])
    rows.append(["apply only", best_keras * 1e3, best_kmix * 1e3, best_kmix / best_keras, median(ratios), "-"])
    print(format_table(
        ["compiled", "keras ms/step", "kmix ms/step", "kmix / keras", "median ratio", "same weights"],
        rows,
    ))
    return rows
