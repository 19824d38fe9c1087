"""`bench gpu`'s routes: the GPT training step on one route, alone, timed in rounds long enough to hold.

Each route is built, compiled (two steps) and timed by itself
(`kmix.benchmarks.routes.Route`):

- a one-step `fit`, twice, sizes the rounds: a round runs enough steps to
  last `round_s`, so that `fit`'s fixed cost (its iterator, callbacks, the
  sync at its end) is a small share of it; `overhead` is that share,
  estimated from the one-step `fit` against the rounds' steps;
- the device's memory statistics are reset after the compile, so that the
  peak is the training step's (with the weights and optimizer state), not
  the buffers XLA's autotuning takes while it compiles;
- the figure is the median round, with its `spread` (interquartile range
  over the median); `skipped` counts the steps that did not advance
  `optimizer.iterations` (a loss-scale optimizer skips non-finite steps)
  and `scale` is a loss-scale optimizer's final scale.

An error (out of memory, a failed compile) becomes the route's result:
`{"label": ..., "error": "..."}`, and the next route runs.
"""

import gc
import math
import time

import keras
import tensorflow as tf

from kmix.benchmarks.gpt import model_flops_per_token
from kmix.benchmarks.memory import device_name
from kmix.benchmarks.routes import Route
from kmix.route import timing


def _peak(device, reset=False):
    """The allocator's peak bytes on `device` (resets it with `reset`); None where it keeps no statistics."""
    try:
        if reset:
            tf.config.experimental.reset_memory_stats(device)
            return None
        return tf.config.experimental.get_memory_info(device)["peak"]
    except (ValueError, tf.errors.InvalidArgumentError):  # a CPU allocator without statistics
        return None


def _free():
    keras.backend.clear_session()
    gc.collect()


def _timed_fit(route, steps):
    begin = time.perf_counter()
    route.train(steps)  # `fit` returns its logs as numbers: the device is done
    return time.perf_counter() - begin


def steps_per_round(one_step_s, round_s, min_steps, max_steps):
    """Steps that make a round last about `round_s`, from a one-step `fit`'s seconds, within the limits."""
    return max(min_steps, min(max_steps, math.ceil(round_s / max(one_step_s, 1e-9))))


def fit_overhead(one_step_s, round_s, steps):
    """`fit`'s fixed cost as a share of a round of `steps` steps that took `round_s` (a one-step `fit`: `one_step_s`).

    A round is `fixed + steps * step`, a one-step `fit` `fixed + step`: so
    `step = (round_s - one_step_s) / (steps - 1)` and `fixed = one_step_s - step`.
    """
    if steps < 2:
        return None
    step = (round_s - one_step_s) / (steps - 1)
    return min(1.0, max(0.0, one_step_s - step) / round_s)


def measure(spec, size):
    """Builds, compiles and times one route alone; returns its figures, or its error, as a dict.

    Args:
        spec: `(label, policy, stack, tf32, jit_compile)`, as `kmix.benchmarks.gpu.ROUTES`.
        size: the GPT's (`kmix.benchmarks.routes.build`) and `rounds`, `round_s`, `min_steps`, `max_steps`.

    Returns:
        `label`, `policy`, `stack`, `tf32`, `jit_compile`, `step_seconds` (the median round's seconds
        per step), `rounds` (seconds per step of each), `steps` (per round), `spread`, `overhead`,
        `tokens_per_second`, `tflops`, `peak_bytes` (None where not measured), `loss_first` (the first
        step's), `loss` (the last step's), `steps_run`, `skipped`, `scale` (None without loss scaling);
        or `label`, `policy`, `stack`, `tf32`, `jit_compile` and `error`.
    """
    label, policy, stack, tf32, jit_compile = spec
    head = {"label": label, "policy": policy, "stack": stack, "tf32": tf32, "jit_compile": jit_compile}
    previous = tf.config.experimental.tensor_float_32_execution_enabled()
    device = device_name()
    route = None
    try:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
        _free()
        route = Route("gpt", size, policy, stack, jit_compile)
        route.train(1)  # traces or compiles the step, builds the optimizer
        loss_first = route.loss
        route.train(1)
        one = min(_timed_fit(route, 1) for _ in range(2))
        steps = steps_per_round(one, size["round_s"], size["min_steps"], size["max_steps"])
        _peak(device, reset=True)  # after the compile: XLA's autotuning buffers are not the step's
        totals = [_timed_fit(route, steps) for _ in range(size["rounds"])]
        peak = _peak(device)
        return {**head, **_figures(route, size, one, steps, totals, peak, loss_first)}
    except Exception as error:  # noqa: BLE001  (the route's row says what went wrong; the next route runs)
        return {**head, "error": describe(error)}
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(previous)
        keras.config.set_dtype_policy("float32")
        del route
        _free()


def _figures(route, size, one, steps, totals, peak, loss_first):
    rounds = [t / steps for t in totals]
    step = timing.median(rounds)
    optimizer = route.model.optimizer
    steps_run = 4 + steps * len(totals)
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and getattr(optimizer, "dynamic", True)
    flops = model_flops_per_token(route.model, size["layers"], size["d_model"], size["seq"])
    return {
        "policy": route.policy, "jit_compile": route.jit_compile, "step_seconds": step, "rounds": tuple(rounds),
        "steps": steps, "spread": timing.spread(rounds),
        "overhead": fit_overhead(one, timing.median(totals), steps),
        "tokens_per_second": route.items / step, "tflops": flops * route.items / step / 1e12,
        "peak_bytes": peak, "loss_first": loss_first, "loss": route.loss, "steps_run": steps_run,
        "skipped": steps_run - int(optimizer.iterations.numpy()),
        "scale": float(optimizer.dynamic_scale.numpy()) if scaled else None,
    }


def describe(error):
    """`"TypeName: first line of the message"`, at most 300 characters."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= 300 else text[:297] + "..."
