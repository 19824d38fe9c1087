"""Interleaved timing rounds, and the round-by-round statistics that hold still on a shared machine.

    >>> rounds = run_rounds({"a": step_a, "b": step_b}, steps={"a": 4, "b": 4}, budget_s=2.0)
    >>> ratio, noise = paired(rounds["a"], rounds["b"])   # > 1 + noise: b is faster
"""

import math
import statistics
import time

NOISE_FLOOR = 0.03  # no measured noise below 3%: a single machine's timings are not steadier than that
CONFIDENCE = 0.9  # one-sided, for each bound of the median ratio
MIN_ROUNDS = 5  # of every configuration compared: fewer ratios tell too little about the noise
MAX_ROUNDS = 30  # where the noise keeps a comparison open, it stays open


def seconds(fn):
    """Seconds one call of `fn` takes (`fn` returns once the device is done)."""
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


median = statistics.median  # the median of `values`


def spread(values):
    """The interquartile range of `values` over their median (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


def bound_rank(n, confidence=CONFIDENCE):
    """The sign test's `k`: the true median lies above the k-th smallest of `n` ratios with `confidence`.

        >>> [bound_rank(n) for n in (5, 10, 20, 30)]
        [1, 3, 7, 11]
    """
    k, below = 1, 1.0 / 2**n  # below: P(Binomial(n, 1/2) <= k - 1)
    while k < n and below + math.comb(n, k) / 2**n <= 1 - confidence:
        below += math.comb(n, k) / 2**n
        k += 1
    return k


def bounds(a, b):
    """How many times slower `a` is than `b`, round by round: `(low, median, high)` of `a[r] / b[r]`.

    `a`, `b`: seconds per step, one per round (only common rounds count). `low`, `high`: the `bound_rank`-th
    smallest and largest ratio; `(1.0, 1.0, 1.0)` with no common round. Above 1: `b` is faster.
    """
    ratios = sorted(x / y for x, y in zip(a, b))
    if not ratios:
        return 1.0, 1.0, 1.0
    k = bound_rank(len(ratios))
    return ratios[k - 1], median(ratios), ratios[-k]


def paired(a, b):
    """`(ratio, noise)`: `bounds`' median, and how far its lower bound lies below it (at least `NOISE_FLOOR`).

    `b` is faster beyond the noise when `ratio > 1 + noise`; `(1.0, 1.0)` with no common round.
    """
    if not min(len(a), len(b)):
        return 1.0, 1.0
    low, middle, _ = bounds(a, b)
    return middle, max(middle - low, NOISE_FLOOR)


def run_rounds(calls, steps, budget_s, min_rounds=MIN_ROUNDS, max_rounds=MAX_ROUNDS, more=None,
               clock=time.perf_counter, hard_s=None):
    """Times `calls` in interleaved rounds; returns `{key: [seconds per step, one per round]}`.

    Args:
        calls, steps: `{key: fn}`, `fn()` running one step (warmed up, returning once the device is done), and
            `{key: int}`, the steps per round for each key.
        budget_s: seconds for the rounds after the first `min_rounds` (up to `max_rounds`).
        more: optional `fn(rounds) -> keys` asked after each round from `min_rounds` on: the keys that still
            need rounds (none: done).
        clock: seconds now (`time.perf_counter`; a simulation passes its own).
        hard_s: optional seconds after which no round but the first starts, `min_rounds` or not.
    """
    rounds, live, start, r = {key: [] for key in calls}, list(calls), clock(), 0
    while live and r < max_rounds and (r < min_rounds or clock() - start < budget_s):
        if r and hard_s is not None and clock() - start >= hard_s:
            break
        shift = r % len(live)
        for key in live[shift:] + live[:shift]:
            begin = clock()
            for _ in range(steps[key]):
                calls[key]()
            rounds[key].append((clock() - begin) / steps[key])
        r += 1
        if r >= min_rounds and more is not None:
            wanted = set(more({key: list(seconds) for key, seconds in rounds.items()}))
            live = [key for key in live if key in wanted]
    return rounds
