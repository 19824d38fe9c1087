"""Shared pieces of the benchmarks: timing (tables and progress lines come from `kmix._output`)."""

import statistics
import time

from kmix._output import format_table, progress  # noqa: F401  (re-exported for the benchmarks)


def time_call(fn, repeats, warmup=1):
    """Runs `fn()` `warmup` times untimed, then `repeats` times; returns the seconds of each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def steady(dataset):
    """`dataset` without tf.data's autotuning thread, so that a short `fit` ends when its steps do.

    tf.data's autotuning runs in a thread that wakes 10, 20, 40, ... ms apart
    (its period doubles), and a `model.fit` of a few steps often returns
    only at that thread's next wake-up, 10 * (2**k - 1) ms after the epoch's
    iterator started: measured rounds then snap to 310, 630, 1270, 2550 or
    5110 ms whatever the step computes (docs/benchmarks.md, 2026-11-26).
    The benchmarks' datasets are one batch, repeated: nothing to tune.
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def median(values):
    """The median of `values`."""
    return statistics.median(values)
