"""Gradient accumulation under loss scaling: k micro-batches, one step, all or nothing.

Keras's own `gradient_accumulation_steps` lives in the inner optimizer, which a
loss-scale optimizer does not call on a skipped micro-batch: that micro-batch
silently drops out of the sum and the step is biased. Here the accumulation
sits in the loss-scale optimizer instead:

    every micro-batch:  acc += unscaled float32 grads (if finite); window_bad |= overflow
    every k-th:         if window_bad: skip (scale backs off once, one skipped step)
                        else: inner.apply(acc / k)
                        acc = 0; window_bad = False

Windows run across epoch boundaries (nothing is dropped); what is left at the
end of training is applied by `LossScaleOptimizer.flush()` with the number of
micro-batches actually summed as the divisor. Under `tf.distribute` each
replica accumulates its own local gradients; the inner optimizer all-reduces
the means as usual, or, with `allreduce_dtype`, kmix reduces the scaled
means in half precision once per window (a replica that saw an overflow in
the window sends NaN, so every replica skips).
"""

import tensorflow as tf

from kmix.optimizers import allreduce, counters, replicas


def create_state(opt, var_list):
    """Creates the float32 accumulators, the micro-batch counter and the window's overflow flags."""
    opt._accumulators = [
        opt.add_variable(
            shape=tuple(v.shape),
            dtype="float32",
            initializer="zeros",
            aggregation="none",
            name="accumulator_" + (getattr(v, "path", None) or v.name).replace("/", "_").replace(":", "_"),
        )
        for v in var_list
    ]
    opt._micro_step = opt.add_variable(shape=(), dtype="int64", initializer="zeros", aggregation="none", name="micro_step")
    opt._window_nonfinite = opt.add_variable(
        shape=(len(var_list),), dtype="float32", initializer="zeros", aggregation="none", name="window_nonfinite"
    )
    # Which variables receive gradients: fixed per traced step, remembered for `flush`.
    opt._accumulated = [True] * len(var_list)


def add_micro_batch(opt, finite, nonfinite, unscaled, variables, scale, written):
    """Adds one micro-batch; on the k-th, applies the mean or skips the whole step.

    `written`: what this micro-batch's forward pass wrote (`step_state.Written`);
    a skipped window puts back their values from its first micro-batch.
    """
    received = [False] * len(opt._model_variables)
    for g, v in zip(unscaled, variables):
        if g is None:
            continue
        i = opt._index[id(v)]
        received[i] = True
        acc = opt._accumulators[i]
        g = tf.cast(tf.convert_to_tensor(g), tf.float32)  # IndexedSlices become dense here
        acc.assign_add(tf.where(finite, g, tf.zeros_like(g)))
    opt._accumulated = received
    window = tf.convert_to_tensor(opt._window_nonfinite) + nonfinite
    count = tf.convert_to_tensor(opt._micro_step) + 1
    start = opt._window_start(written).take(written, tf.equal(count, 1)) if len(written) else []

    def restore(skipped):
        written.restore(skipped, start)

    _finish(opt, count >= opt.accumulation_steps, window, count, scale, restore)


def flush(opt):
    """Applies what has been accumulated so far, divided by the micro-batches summed."""
    count = tf.convert_to_tensor(opt._micro_step)
    _finish(opt, count > 0, tf.convert_to_tensor(opt._window_nonfinite), count, opt.loss_scale,
            restore=lambda skipped: None)  # outside any step: no forward pass wrote anything


def _finish(opt, end, window, count, scale, restore):
    divisor = tf.cast(tf.maximum(count, 1), tf.float32)
    if allreduce.reduces_here(opt.allreduce_dtype, tf.distribute.get_replica_context()):
        # One half-precision all-reduce per window, on every replica at once (`end` is the same).
        replicas.run_if(end, _reduce_and_apply, opt, window, divisor, scale, restore)
    else:
        clean = tf.equal(tf.reduce_sum(window), 0.0)
        means = [acc / divisor if on else None for acc, on in zip(opt._accumulators, opt._accumulated)]
        opt._apply_if(tf.logical_and(end, clean), means, opt._model_variables)
        counters.record_step(opt, clean, window, scale, active=end)
        restore(tf.logical_and(end, tf.logical_not(clean)))
    for acc in opt._accumulators:
        acc.assign(tf.where(end, tf.zeros_like(acc), acc))
    opt._micro_step.assign(tf.where(end, tf.zeros_like(count), count))
    opt._window_nonfinite.assign(tf.where(end, tf.zeros_like(window), window))


def _reduce_and_apply(opt, window, divisor, scale, restore):
    """Reduces the window's scaled means in `allreduce_dtype`, checks the sums, applies or skips.

    `window` holds this replica's own overflows only: where it saw one, it
    sends NaN for that variable, so the sums show it on every replica.
    """
    means = [acc * (scale / divisor) if on else None for acc, on in zip(opt._accumulators, opt._accumulated)]
    bad = [window[i] > 0 for i in range(len(means))]
    sums = allreduce.all_reduce(means, opt._model_variables, opt.allreduce_dtype, poison=bad)
    nonfinite = counters.nonfinite(opt, sums, opt._model_variables)
    finite = tf.equal(tf.reduce_sum(nonfinite), 0.0)
    opt._apply_if(finite, [None if s is None else s / scale for s in sums], opt._model_variables)
    restore(tf.logical_not(finite))
    counters.record_step(opt, finite, nonfinite, scale)
