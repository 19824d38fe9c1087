"""`bench train`'s measurements: each route alone (with a GPU, with its peak memory) or in interleaved rounds.

`largest_batch` finds the largest batch that trains, by doubling and bisecting.
"""

import tensorflow as tf

import kmix
from kmix.benchmarks.common import allocator_peak, fresh_session, gpu_device, progress, time_call
from kmix.benchmarks.gpt import build_model, compile_model, make_dataset, model_flops_per_token
from kmix.benchmarks.routes import Route
from kmix.route import timing


def _reset():
    fresh_session()
    if gpu_device():
        allocator_peak(gpu_device(), reset=True)


class _Run:
    """One route, built, compiled and traced, ready to time."""

    def __init__(self, config, model_name, size):
        self.model_name, self.size, self.seconds = model_name, size, []
        self.route = Route(model_name, size, *config)
        self.route.train(2)  # traces / compiles the step and builds the optimizer

    def time_round(self, steps):
        """One untimed step (a first call may trace again), then times `steps` steps; keeps seconds per step."""
        self.route.train(1)
        self.seconds.append(time_call(lambda: self.route.train(steps), repeats=1, warmup=0)[0] / steps)

    def result(self, peak_bytes, phase=None):
        """The figures: the median round, and the rounds (`phase`: which interleaved rounds they were in)."""
        step, items, tflops = timing.median(self.seconds), self.route.items, None
        if self.model_name == "gpt":
            flops = model_flops_per_token(self.route.model, self.size["layers"], self.size["d_model"], self.size["seq"])
            tflops = flops * items / step / 1e12
        return {"policy": self.route.policy, "stack": self.route.stack, "jit_compile": self.route.jit_compile,
                "step_seconds": step, "tokens_per_second": items / step, "tflops": tflops, "peak_bytes": peak_bytes,
                "loss": self.route.loss, "rounds": tuple(self.seconds), "phase": phase}


def measure(config, size, steps, rounds, model_name="gpt"):
    """Trains one route alone and returns its figures (see `measure_all`)."""
    return measure_all([config], size, steps, rounds, False, model_name)[0]


def measure_all(configs, size, steps, rounds, interleave, model_name="gpt"):
    """Measures each `(policy, stack, jit_compile)` of `configs` in `rounds` of `steps`; one dict each.

    With `interleave`, every route is built first and their rounds alternate (drift hits all alike);
    otherwise each runs alone, with its own peak memory. The dicts: `policy`, `stack`, `jit_compile`,
    `step_seconds` (the median round), `tokens_per_second`, `tflops`, `peak_bytes`, `loss`, `rounds` and
    `phase` (rows of one phase ran in the same rounds; None when alone).
    """
    # TensorFlow's rewrite runs last, alone: once its option has been set and unset, the functions of
    # the other routes ran slower for the rest of the process on our CPUs (2026-11-23).
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
            runs[i] = _Run(configs[i], model_name, size)
        live = list(runs.values())
        for r in range(rounds):
            if interleave:
                alone = " (the rewrite, alone)" if configs[group[0]][1] == "tf-rewrite" else ""
                progress(f"timing round {r + 1}/{rounds}{alone}")
            for run in live[r % len(live):] + live[:r % len(live)]:
                run.time_round(steps)
        peak = None if interleave or gpu_device() is None else allocator_peak(gpu_device())
        for i, run in runs.items():
            results[i] = run.result(peak, phase if interleave else None)
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
    """The largest batch that trains, doubling from `start`, then bisecting to within 1/16 below the limit.

    Returns:
        `(batch, capped)`: the batch and whether `limit` was reached before anything failed.
    """
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
