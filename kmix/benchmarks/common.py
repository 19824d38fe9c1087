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


def median(values):
    """The median of `values`."""
    return statistics.median(values)
