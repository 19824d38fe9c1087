"""Interleaved timing rounds and the statistics that hold still on a shared machine.

`kmix.recommend` compares configurations (dtype x compilation) whose speeds
differ by a few percent, on machines where other work comes and goes. Four
rules keep the answer steady:

- rounds are interleaved: round r times every live configuration once, in
  an order that rotates, so that drift hits them all alike;
- a configuration's figure is the median of its rounds (one disturbed
  round moves it little), shown with its spread (interquartile range over
  the median);
- two configurations are compared round by round: `bounds(a, b)` is the
  median of `a[r] / b[r]` with a distribution-free confidence interval
  around it (the sign test's: the k-th smallest and k-th largest ratio, k
  from the binomial distribution, `CONFIDENCE` one-sided), and `paired`
  gives the median and its noise, how far the lower bound lies below it;
  `b` is faster beyond the noise when that lower bound is above 1 (and the
  `NOISE_FLOOR`). Unlike a quartile, the bound closes in on the median as
  rounds are added, so more rounds can settle what a few could not;
- after `min_rounds`, only the configurations the caller still needs
  (`more`) get further rounds, while the budget lasts; `hard_s` stops
  even the minimum, where a caller's budget must hold under any load.

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


def median(values):
    """The median of `values`."""
    return statistics.median(values)


def spread(values):
    """The interquartile range of `values` over their median (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


def bound_rank(n, confidence=CONFIDENCE):
    """Which order statistic of `n` ratios bounds their true median: the sign test's `k` (1-based).

    The largest `k` with `P(Binomial(n, 1/2) < k) <= 1 - confidence`: the
    true median lies above the k-th smallest of `n` independent ratios (and
    below the k-th largest) with at least that confidence. At least 1: with
    fewer than 4 rounds no order statistic reaches 90%, and the extreme
    ratio is the bound. Examples: 5 rounds -> 1, 10 -> 3, 20 -> 7, 30 -> 11.
    """
    k, below = 1, 1.0 / 2**n  # below: P(Binomial(n, 1/2) <= k - 1)
    while k < n and below + math.comb(n, k) / 2**n <= 1 - confidence:
        below += math.comb(n, k) / 2**n
        k += 1
    return k


def bounds(a, b):
    """How many times slower `a` is than `b`, round by round: `(low, median, high)`.

    Args:
        a, b: seconds per step of two configurations, one entry per round
            (the same rounds; one timed for fewer rounds has fewer entries,
            and only the rounds both have count).

    Returns:
        The median of `a[r] / b[r]` (above 1: `b` is faster) and the bounds
        of its confidence interval, the `bound_rank`-th smallest and largest
        ratio. `(1.0, 1.0, 1.0)` with no common round.
    """
    ratios = sorted(x / y for x, y in zip(a, b))
    if not ratios:
        return 1.0, 1.0, 1.0
    k = bound_rank(len(ratios))
    return ratios[k - 1], median(ratios), ratios[-k]


def paired(a, b):
    """How many times slower `a` is than `b`, round by round: `(median ratio, noise)`.

    Args:
        a, b: as for `bounds`.

    Returns:
        `(ratio, noise)`: the median of `a[r] / b[r]` (above 1: `b` is
        faster) and how far the lower bound of its confidence interval lies
        below it, at least `NOISE_FLOOR` (1.0 with no common round). `b` is
        faster beyond the noise when `ratio > 1 + noise`.
    """
    if not min(len(a), len(b)):
        return 1.0, 1.0
    low, middle, _ = bounds(a, b)
    return middle, max(middle - low, NOISE_FLOOR)


def run_rounds(calls, steps, budget_s, min_rounds=MIN_ROUNDS, max_rounds=MAX_ROUNDS, more=None, report=None,
               clock=time.perf_counter, hard_s=None):
    """Times `calls` in interleaved rounds; returns `{key: [seconds per step, one per round]}`.

    Args:
        calls: `{key: fn}`; `fn()` runs one step and returns once the device
            is done (the caller warms each up first).
        steps: `{key: int}`: steps per round for each key (so that a round
            of a fast step is not all timer overhead).
        budget_s: seconds for all the rounds. Every key gets `min_rounds`
            rounds, spent or not; then rounds go on while the budget lasts,
            up to `max_rounds`.
        more: optional `fn(rounds) -> keys`, asked after each round from
            `min_rounds` on: the keys that still need rounds (the others are
            timed no more; none: done). Without it every key goes on.
        report: optional `fn(round_number)` called after each round.
        clock: seconds now (`time.perf_counter`; a simulation passes its own).
        hard_s: optional seconds after which no round starts but the first,
            `min_rounds` or not (the rounds per key say how many ran).
    """
    rounds = {key: [] for key in calls}
    live = list(calls)
    start = clock()
    r = 0
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
        if report is not None:
            report(r)
        if r >= min_rounds and more is not None:
            wanted = set(more({key: list(seconds) for key, seconds in rounds.items()}))
            live = [key for key in live if key in wanted]
    return rounds
