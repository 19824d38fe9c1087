"""Interleaved timing rounds and the statistics that hold still on a shared machine.

`kmix.recommend` compares configurations (dtype x compilation) whose speeds
differ by a few percent, on machines where other work comes and goes. Three
rules keep the answer steady:

- rounds are interleaved: round r times every live configuration once, in
  an order that rotates, so that drift hits them all alike;
- a configuration's figure is the median of its rounds (one disturbed
  round moves it little), shown with its spread (interquartile range over
  the median);
- two configurations are compared round by round: `paired(a, b)` is the
  median of `a[r] / b[r]`, and its noise how far the lower quartile of those
  ratios falls below it; `b` wins only by more than that noise, that is
  when `b` was faster in at least three rounds of four (by more than
  `NOISE_FLOOR`). A round where `b` looks much faster does not count
  against it.

    >>> rounds = run_rounds({"a": step_a, "b": step_b}, steps={"a": 4, "b": 4}, budget_s=2.0)
    >>> ratio, noise = paired(rounds["a"], rounds["b"])   # > 1: b is faster
"""

import statistics
import time

NOISE_FLOOR = 0.03  # no measured noise below 3%: a single machine's timings are not steadier than that
MIN_ROUNDS = 3
MAX_ROUNDS = 15
PRUNE = 1.5  # after two rounds, a configuration this much slower than the fastest is timed no more


def median(values):
    """The median of `values`."""
    return statistics.median(values)


def spread(values):
    """The interquartile range of `values` over their median (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


def paired(a, b):
    """How many times slower `a` is than `b`, round by round: `(median ratio, noise)`.

    Args:
        a, b: seconds per step of two configurations, one entry per round
            (the same rounds; a configuration pruned early has fewer, and
            only the rounds both have count).

    Returns:
        `(ratio, noise)`: the median of `a[r] / b[r]` (above 1: `b` is
        faster) and how far the lower quartile of those ratios is below
        it, at least `NOISE_FLOOR`. `b` is faster beyond the noise when
        `ratio > 1 + noise`: its lower quartile is above 1 (+ the floor).
    """
    ratios = [x / y for x, y in zip(a, b)]
    if not ratios:
        return 1.0, 1.0
    middle = median(ratios)
    lower = statistics.quantiles(ratios, n=4, method="inclusive")[0] if len(ratios) > 1 else middle
    return middle, max(middle - lower, NOISE_FLOOR)


def run_rounds(calls, steps, budget_s, min_rounds=MIN_ROUNDS, max_rounds=MAX_ROUNDS, prune=PRUNE, report=None):
    """Times `calls` in interleaved rounds; returns `{key: [seconds per step, one per round]}`.

    Args:
        calls: `{key: fn}`; `fn()` runs one step and returns once the device
            is done (the caller warms each up first).
        steps: `{key: int}`: steps per round for each key (so that a round
            of a fast step is not all timer overhead).
        budget_s: seconds for all the rounds: rounds go on until it is spent
            (at least `min_rounds`, at most `max_rounds`).
        prune: after two rounds a key whose median is more than `prune`
            times the fastest median is timed no more (it cannot win).
        report: optional `fn(round_number)` called after each round.
    """
    rounds = {key: [] for key in calls}
    live = list(calls)
    start = time.perf_counter()
    r = 0
    while r < max_rounds and (r < min_rounds or time.perf_counter() - start < budget_s):
        shift = r % len(live)
        for key in live[shift:] + live[:shift]:
            begin = time.perf_counter()
            for _ in range(steps[key]):
                calls[key]()
            rounds[key].append((time.perf_counter() - begin) / steps[key])
        r += 1
        if report is not None:
            report(r)
        if r >= 2 and prune:
            fastest = min(median(rounds[key]) for key in live)
            live = [key for key in live if median(rounds[key]) <= prune * fastest]
    return rounds
