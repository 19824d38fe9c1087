"""`bench train`'s measurements: each route alone or in interleaved rounds, and the largest batch that trains."""

import tensorflow as tf

from kmix.benchmarks.common import allocator_peak, alternate, fresh_session, gpu_device, progress
from kmix.benchmarks.routes import Route


def _reset():
    fresh_session()
    if gpu_device():
        allocator_peak(gpu_device(), reset=True)


def measure(config, size, steps, rounds, model_name="gpt"):
    """Trains one route alone and returns its figures (see `measure_all`)."""
    return measure_all([config], size, steps, rounds, False, model_name)[0]


def measure_all(configs, size, steps, rounds, interleave, model_name="gpt"):
    """A dict per `(policy, stack, jit_compile)` of `configs`: `rounds` of `steps`, alone or interleaved."""
    # TensorFlow's rewrite runs last, alone: once set and unset, it slowed the other routes on our CPUs (2026-11-23).
    order = sorted(range(len(configs)), key=lambda i: configs[i][1] == "tf-rewrite")
    groups = [[i for i in order if (configs[i][1] == "tf-rewrite") == last] for last in (False, True)]
    results, built = [None] * len(configs), 0
    for phase, group in enumerate(g for g in (groups if interleave else [[i] for i in order]) if g):
        _reset()
        runs = {}
        for i in group:
            built += 1
            compile_mode = {True: "XLA", False: "tf.function"}.get(configs[i][2], "default compile")
            progress(f"[{built}/{len(configs)}] {'building and compiling ' * interleave}"
                     f"{configs[i][0]}, {configs[i][1]}, {compile_mode}")
            runs[i] = Route(model_name, size, *configs[i])
            runs[i].train(2)  # traces / compiles the step and builds the optimizer
        alone = " (the rewrite, alone)" if configs[group[0]][1] == "tf-rewrite" else ""
        say = (lambda r, _: progress(f"timed round {r + 1}/{rounds}{alone}")) if interleave else None
        # Each round: one untimed step first (a first call may trace again), then `steps` timed.
        seconds = alternate({i: (lambda route=route: route.train(steps)) for i, route in runs.items()}, rounds,
                            warmup=0, after_round=say, rotate=True, before=lambda i: runs[i].train(1))
        peak = None if interleave or gpu_device() is None else allocator_peak(gpu_device())
        for i, route in runs.items():
            results[i] = {**route.figures([t / steps for t in seconds[i]], peak),
                          "phase": phase if interleave else None}
    return results


def fits(policy, stack, size, batch):
    """Whether two XLA-compiled training steps at `batch` run without running out of memory."""
    _reset()
    try:
        Route("gpt", {**size, "batch": batch}, policy, stack, True).train(2)
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
    """`(batch, capped)`: the largest batch that trains, doubling from `start` then bisecting to within 1/16 below
    the limit, and whether `limit` was reached before anything failed."""
    lo, hi = (start, None) if fits(policy, stack, size, start) else (0, start)
    while hi is None:
        nxt = min(lo * 2, limit)
        progress(f"  {policy}: batch {lo} fits; trying {nxt}")
        if nxt == lo:
            return lo, True
        lo, hi = (nxt, None) if fits(policy, stack, size, nxt) else (lo, nxt)
    while hi - lo > max(1, lo // 16):
        mid = (lo + hi) // 2
        progress(f"  {policy}: between {lo} and {hi}; trying {mid}")
        lo, hi = (mid, hi) if fits(policy, stack, size, mid) else (lo, mid)
    return lo, False
