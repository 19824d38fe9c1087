"""`bench gpu`'s routes: the GPT training step on one route, alone, in rounds of about `round_s` each."""

import math

import keras
import tensorflow as tf

from kmix.benchmarks.common import allocator_device, allocator_peak, fresh_session, measured, time_call
from kmix.benchmarks.routes import Route
from kmix.route import timing


def steps_per_round(one_step_s, round_s, min_steps, max_steps):
    """Steps that make a round last about `round_s`, from a one-step `fit`'s seconds, within the limits."""
    return max(min_steps, min(max_steps, math.ceil(round_s / max(one_step_s, 1e-9))))


def fit_overhead(one_step_s, round_s, steps):
    """`fit`'s fixed cost as a share of a round: a round is `fixed + steps * step`, a one-step `fit` `fixed + step`."""
    if steps < 2:
        return None
    step = (round_s - one_step_s) / (steps - 1)
    return min(1.0, max(0.0, one_step_s - step) / round_s)


def measure(spec, size):
    """One route (`spec` as `gpu.ROUTES`') built, compiled and timed alone: its figures, or its error, as a dict."""
    label, policy, stack, tf32, jit_compile = spec
    head = {"label": label, "policy": policy, "stack": stack, "tf32": tf32, "jit_compile": jit_compile}
    previous = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        return measured(lambda: {**head, **_run(policy, stack, tf32, jit_compile, size)}, **head)
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(previous)
        keras.config.set_dtype_policy("float32")
        fresh_session()


def _run(policy, stack, tf32, jit_compile, size):
    tf.config.experimental.enable_tensor_float_32_execution(tf32)
    fresh_session()
    device, route = allocator_device(), Route("gpt", size, policy, stack, jit_compile)
    route.train(1)  # traces or compiles the step, builds the optimizer
    loss_first, one = route.loss, min(time_call(lambda: route.train(1), 2, warmup=1))
    steps = steps_per_round(one, size["round_s"], size["min_steps"], size["max_steps"])
    allocator_peak(device, reset=True)  # after the compile: XLA's autotuning buffers are not the step's
    totals = time_call(lambda: route.train(steps), size["rounds"], warmup=0)
    rounds, optimizer, steps_run = [t / steps for t in totals], route.model.optimizer, 4 + steps * len(totals)
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and getattr(optimizer, "dynamic", True)
    return {**route.figures(rounds, allocator_peak(device)), "steps": steps, "spread": timing.spread(rounds),
            "overhead": fit_overhead(one, timing.median(totals), steps), "loss_first": loss_first,
            "steps_run": steps_run, "skipped": steps_run - int(optimizer.iterations.numpy()),
            "scale": float(optimizer.dynamic_scale.numpy()) if scaled else None}
