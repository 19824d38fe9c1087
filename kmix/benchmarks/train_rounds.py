"""`bench train`'s measurements: each route built, warmed up and timed, alone or in interleaved rounds.

With a GPU each route runs alone and its peak memory is
`tf.config.experimental.get_memory_info` of the first GPU; without one the
routes are built first and their rounds alternate, in an order that rotates
from round to round, so that drift on a shared machine hits all alike (no
memory figure then: `bench memory` measures the CPU's). TensorFlow's own
rewrite (`tf-rewrite`) runs after the others, alone. `largest_batch` finds
the largest batch that trains, by doubling and bisecting.
"""

import gc

import keras
import tensorflow as tf

import kmix
from kmix.benchmarks.common import progress, time_call
from kmix.benchmarks.gpt import build_model, compile_model, make_dataset, model_flops_per_token
from kmix.benchmarks.routes import Route
from kmix.route import timing


def gpu_name():
    """`"GPU:0"` if TensorFlow sees a GPU, else None."""
    return "GPU:0" if tf.config.list_physical_devices("GPU") else None


def _reset():
    keras.backend.clear_session()
    gc.collect()
    device = gpu_name()
    if device is not None:
        tf.config.experimental.reset_memory_stats(device)


class _Run:
    """One route, built, compiled and traced, ready to time."""

    def __init__(self, config, model_name, size):
        policy, stack, jit_compile = config
        self.config, self.model_name, self.size, self.seconds = config, model_name, size, []
        self.route = Route(model_name, size, policy, stack, jit_compile)
        self.route.train(2)  # traces / compiles the step and builds the optimizer

    def time_round(self, steps):
        """One untimed step, then times `steps` steps; keeps the seconds per step.

        The untimed step absorbs a first call that traces or instantiates
        anything again.
        """
        self.route.train(1)
        self.seconds.append(time_call(lambda: self.route.train(steps), repeats=1, warmup=0)[0] / steps)

    def result(self, peak_bytes, phase=None):
        """The figures: the median round, and the rounds (`phase`: which interleaved rounds they were in)."""
        step = timing.median(self.seconds)
        items = self.route.items
        tflops = None
        if self.model_name == "gpt":
            flops = model_flops_per_token(self.route.model, self.size["layers"], self.size["d_model"],
                                          self.size["seq"])
            tflops = flops * items / step / 1e12
        return {
            "policy": self.route.policy,
            "stack": self.route.stack,
            "jit_compile": self.route.jit_compile,
            "step_seconds": step,
            "tokens_per_second": items / step,
            "tflops": tflops,
            "peak_bytes": peak_bytes,
            "loss": self.route.loss,
            "rounds": tuple(self.seconds),
            "phase": phase,
        }


def measure(config, size, steps, rounds, model_name="gpt"):
    """Trains one route alone and returns its figures (see `measure_all`)."""
    _reset()
    run = _Run(config, model_name, size)
    for _ in range(rounds):
        run.time_round(steps)
    device = gpu_name()
    return run.result(tf.config.experimental.get_memory_info(device)["peak"] if device else None)


def measure_all(configs, size, steps, rounds, interleave, model_name="gpt"):
    """Measures every route; returns one dict of figures per route.

    Args:
        configs: `(policy, stack, jit_compile)` triples.
        size: see `kmix.benchmarks.routes.build`.
        steps: steps per timed round.
        rounds: timed rounds; the step time is the median round.
        interleave: build every route first, then time round 1 of each,
            round 2 of each, ...: drift on a shared machine then hits all of
            them alike. Otherwise each runs alone, after the previous one is
            freed, so that its peak device memory is its own. Either way
            the `tf-rewrite` route runs after the others (alone), since
            switching TensorFlow's rewrite on and off slows the functions of
            routes that run after it. Interleaved rounds rotate the order
            of the routes from one round to the next.
        model_name: one of `kmix.benchmarks.routes.MODELS`.

    Returns:
        Dicts with `policy`, `stack`, `jit_compile` (as resolved: Keras's
        `"auto"` becomes a bool), `step_seconds`, `tokens_per_second` (items:
        tokens for the GPT, images for ResNet), `tflops` (None for ResNet),
        `peak_bytes` (None where the device does not report it, and when
        interleaved), `loss` (the last training loss, to show it trained),
        `rounds` (seconds per step of each round) and `phase` (routes of
        the same phase ran in the same interleaved rounds, so their ratios
        are taken round by round; None when each ran alone).
    """
    label = lambda c: f"{c[0]}, {c[1]}, {'XLA' if c[2] is True else 'tf.function' if c[2] is False else 'default compile'}"  # noqa: E731
    # TensorFlow's rewrite runs last: once its option has been set and unset, the functions of
    # the other routes ran slower for the rest of the process on our CPUs (2026-11-23).
    order = sorted(range(len(configs)), key=lambda i: configs[i][1] == "tf-rewrite")
    results = [None] * len(configs)
    if not interleave:
        for n, i in enumerate(order, 1):
            progress(f"[{n}/{len(configs)}] {label(configs[i])}")
            results[i] = measure(configs[i], size, steps, rounds, model_name)
        return results
    _reset()
    phases = [[i for i in order if configs[i][1] != "tf-rewrite"], [i for i in order if configs[i][1] == "tf-rewrite"]]
    done = 0
    for phase in phases:
        runs = {}
        for i in phase:
            done += 1
            progress(f"[{done}/{len(configs)}] building and compiling {label(configs[i])}")
            runs[i] = _Run(configs[i], model_name, size)
        live = list(runs.values())
        for r in range(rounds if runs else 0):
            progress(f"timing round {r + 1}/{rounds}" + (" (the rewrite, alone)" if phase is phases[1] else ""))
            for run in live[r % len(live):] + live[:r % len(live)]:
                run.time_round(steps)
        for i, run in runs.items():
            results[i] = run.result(None, phases.index(phase))
    return results


def fits(policy, stack, size, batch):
    """Whether two XLA-compiled training steps at `batch` run without running out of memory."""
    _reset()
    try:
        with kmix.policy_scope(policy):
            model = build_model(size["layers"], size["d_model"], size["heads"], size["seq"], size["vocab"], stack)
            compile_model(model, stack, jit_compile=True)
        data = make_dataset(batch, size["seq"], size["vocab"])
        model.fit(data, steps_per_epoch=2, epochs=1, shuffle=False, verbose=0)
        return True
    except tf.errors.ResourceExhaustedError:
        return False
    except tf.errors.InternalError as e:  # XLA reports some allocation failures this way
        if "out of memory" in str(e).lower() or "resource_exhausted" in str(e).lower():
            return False
        raise
    finally:
        _reset()


def largest_batch(policy, stack, size, start, limit):
    """The largest batch that trains, doubling from `start`, then bisecting.

    Bisection stops when the gap is within 1/16 of the batch (or 1), so the
    answer is within about 6% below the true limit.

    Returns:
        `(batch, capped)`: the largest batch found and whether `limit` was
        reached before anything failed (then the real limit is higher).
    """
    if not fits(policy, stack, size, start):
        lo, hi = 0, start
    else:
        lo, hi = start, None
        while hi is None:
            nxt = min(lo * 2, limit)
            progress(f"  {policy}: batch {lo} fits; trying {nxt}")
            if nxt == lo:
                return lo, True
            if fits(policy, stack, size, nxt):
                lo = nxt
            else:
                hi = nxt
    while hi - lo > max(1, lo // 16):
        mid = (lo + hi) // 2
        progress(f"  {policy}: between {lo} and {hi}; trying {mid}")
        if fits(policy, stack, size, mid):
            lo = mid
        else:
            hi = mid
    return lo, False
