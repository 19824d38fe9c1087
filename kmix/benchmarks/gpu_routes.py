"""`bench gpu`'s routes: the GPT training step on one route, alone, in rounds of about `round_s` each."""

import math

import keras
import tensorflow as tf

from kmix.benchmarks.common import allocator_peak, fresh_session, measured, time_call
from kmix.benchmarks.gpt import model_flops_per_token
from kmix.benchmarks.memory import device_name
from kmix.benchmarks.routes import Route
from kmix.route import timing


def steps_per_round(one_step_s, round_s, min_steps, max_steps):
    """Steps that make a round last about `round_s`, from a one-step `fit`'s seconds, within the limits."""
    return max(min_steps, min(max_steps, math.ceil(round_s / max(one_step_s, 1e-9))))


def fit_overhead(one_step_s, round_s, steps):
    """`fit`'s fixed cost as a share of a round of `steps` steps that took `round_s` (a one-step `fit`: `one_step_s`).

    A round is `fixed + steps * step` and a one-step `fit` `fixed + step`.
    """
    if steps < 2:
        return None
    step = (round_s - one_step_s) / (steps - 1)
    return min(1.0, max(0.0, one_step_s - step) / round_s)


def measure(spec, size):
    """Builds, compiles and times one route alone (`spec` as `gpu.ROUTES`'); its figures, or its error, as a dict.

    `size` is the GPT's and `rounds`, `round_s`, `min_steps`, `max_steps`. The dict: the spec's fields, then
    `step_seconds`, `rounds`, `steps`, `spread`, `overhead`, `tokens_per_second`, `tflops`, `peak_bytes`,
    `loss_first`, `loss`, `steps_run`, `skipped` and `scale` (None without loss scaling); or `error`.
    """
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
    device = device_name()
    route = Route("gpt", size, policy, stack, jit_compile)
    route.train(1)  # traces or compiles the step, builds the optimizer
    loss_first = route.loss
    route.train(1)
    one = min(time_call(lambda: route.train(1), 2, warmup=0))
    steps = steps_per_round(one, size["round_s"], size["min_steps"], size["max_steps"])
    allocator_peak(device, reset=True)  # after the compile: XLA's autotuning buffers are not the step's
    totals = time_call(lambda: route.train(steps), size["rounds"], warmup=0)
    return _figures(route, size, one, steps, totals, allocator_peak(device), loss_first)


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
