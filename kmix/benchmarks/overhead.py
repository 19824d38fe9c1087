"""`python -m kmix bench overhead`: step time of kmix against Keras's LossScaleOptimizer."""

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix.benchmarks.common import add_options, alternate, bench_parser, compiled, format_table, median, progress


def build_and_compile(kind, layers, width, jit_compile, seed=0, batchnorm=False, restore=True):
    """`layers` of `Dense(width)` (each followed by a `BatchNormalization` with `batchnorm`), compiled with `kind`'s."""
    keras.utils.set_random_seed(seed)
    stack = [keras.Input((width,))]
    for _ in range(layers):
        stack += [keras.layers.Dense(width, activation="relu")] + [keras.layers.BatchNormalization()] * batchnorm
    model = keras.Sequential(stack + [keras.layers.Dense(1, dtype="float32")])
    inner = keras.optimizers.Adam(1e-4)
    # Keras's Adam arithmetic in both (not kmix's fused kernel): only the loss-scale machinery differs, bit for bit.
    opt = (keras.optimizers.LossScaleOptimizer(inner) if kind == "keras"
           else kmix.wrap(inner, restore_on_skip=restore, fused_update=False))
    model.compile(optimizer=opt, loss="mse", jit_compile=jit_compile)
    return model


def measure(layers=64, width=16, batch=32, steps=200, rounds=5, jit_compile=False, batchnorm=False, restore=True):
    """`({kind: [seconds per step, one per round]}, whether both ended with bit-identical weights)`."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, width)).astype("float32")
    y = rng.normal(size=(batch * steps, 1)).astype("float32")
    with kmix.policy_scope("mixed_float16"):
        models = {kind: build_and_compile(kind, layers, width, jit_compile, batchnorm=batchnorm, restore=restore)
                  for kind in ("keras", "kmix")}
    fits = {kind: (lambda m=model: m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0))
            for kind, model in models.items()}
    times = alternate(fits, rounds, after_round=lambda r, t: progress(f"round {r + 1}/{rounds}: " + ", ".join(
        f"{kind} {t[kind][-1] / steps * 1e3:.3f} ms/step" for kind in ("keras", "kmix"))))
    same_weights = all(np.array_equal(a, b) for a, b in zip(*(m.get_weights() for m in models.values())))
    return {kind: [t / steps for t in seconds] for kind, seconds in times.items()}, same_weights


def measure_apply(layers=64, width=16, steps=200, rounds=5):
    """Times `optimizer.apply` alone in a `tf.function` (the part kmix changes); `{kind: [seconds per apply]}`."""
    shapes = [(width, width), (width,)] * layers + [(width, 1), (1,)]
    variables, grads = [keras.Variable(np.ones(s, np.float32)) for s in shapes], [tf.ones(s) for s in shapes]
    loops = {}
    for kind in ("keras", "kmix"):
        inner = keras.optimizers.Adam(1e-4)
        opt = (keras.optimizers.LossScaleOptimizer(inner) if kind == "keras"
               else kmix.wrap(inner, dynamic=True, initial_scale=2.0**15))
        opt.build(variables)
        extra = {"scaled": True} if kind == "kmix" else {}  # the gradients stand for a scaled loss's
        apply = tf.function(lambda opt=opt, extra=extra: opt.apply(grads, variables, **extra))
        loops[kind] = lambda apply=apply: [apply() for _ in range(steps)]
    return {kind: [t / steps for t in times] for kind, times in alternate(loops, rounds).items()}


def main(argv=None):
    """Prints the kmix / Keras step-time table; returns its rows (the last: `optimizer.apply` alone)."""
    parser = bench_parser("overhead", __doc__)
    add_options(parser, layers=(64, "Dense layers (2 variables each)"), width=(16, "units per layer"),
                batch=(32, "batch size"), steps=(200, "steps per timed round"), rounds=(5, "alternating rounds"),
                no_jit="only tf.function, skip the XLA-compiled run",
                batchnorm="a BatchNormalization after each Dense: the cost of restoring skipped steps' state",
                no_restore="kmix with restore_on_skip=False (Keras's behaviour for non-trainable state)")
    args, rows = parser.parse_args(argv), []
    for jit in ([False] if args.no_jit else [False, True]):
        label = compiled(jit)
        progress(f"{label}: {args.layers} layers x {args.width} units, {2 * args.layers + 2} variables")
        per_step, same = measure(args.layers, args.width, args.batch, args.steps, args.rounds, jit,
                                 args.batchnorm, not args.no_restore)
        rows.append([label, *_compared(per_step), "yes" if same else "NO"])
    progress("optimizer.apply alone, in a tf.function")
    rows.append(["apply only", *_compared(measure_apply(args.layers, args.width, args.steps, args.rounds)), "-"])
    print(format_table(["compiled", "keras ms/step", "kmix ms/step", "kmix / keras", "median ratio", "same weights"],
                       rows))
    return rows


def _compared(seconds):
    """Keras's and kmix's fastest round (ms), their ratio and the median of the per-round ratios."""
    best_keras, best_kmix = min(seconds["keras"]), min(seconds["kmix"])
    ratios = [b / a for a, b in zip(seconds["keras"], seconds["kmix"])]
    return [best_keras * 1e3, best_kmix * 1e3, best_kmix / best_keras, median(ratios)]
