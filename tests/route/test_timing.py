"""`kmix.route.timing`: interleaved rounds and the statistics `kmix.recommend` decides from."""

import itertools
import statistics

import numpy as np
import pytest

from kmix.route import timing


def test_bound_rank_against_counting_every_sign_pattern():
    # The sign test, counted by brute force: of the 2^n equally likely patterns of rounds above and
    # below the true median, the share with fewer than k below must be at most 1 - CONFIDENCE.
    for n in range(1, 15):
        patterns = list(itertools.product((0, 1), repeat=n))
        share_below = lambda k: sum(sum(p) < k for p in patterns) / len(patterns)  # noqa: E731
        k = timing.bound_rank(n)
        if k > 1:
            assert share_below(k) <= 1 - timing.CONFIDENCE
        assert k == n or share_below(k + 1) > 1 - timing.CONFIDENCE  # the tightest such k
    assert [timing.bound_rank(n) for n in (5, 10, 20, 30)] == [1, 3, 7, 11]


def test_spread_and_paired_against_hand_computed_values():
    # Quartiles of (1, 2, 3, 4, 5), inclusive: 2 and 4; IQR 2 over the median 3.
    assert timing.spread([5, 1, 4, 2, 3]) == pytest.approx(2 / 3)
    assert timing.spread([7.0]) == 0.0
    a = [1.0, 1.2, 2.0]  # a machine that slows down: both slow alike
    b = [0.5, 0.6, 1.0]
    ratio, noise = timing.paired(a, b)
    assert ratio == pytest.approx(2.0) and noise == timing.NOISE_FLOOR  # the drift cancels out
    # Unpaired, the same figures look noisy: the median of each moves with the drift.
    assert timing.spread(a) > 0.3
    # Five rounds: the bound is the smallest ratio (bound_rank(5) == 1).
    down = [1.2, 1.2, 1.2, 0.8, 0.9]
    assert timing.bounds(down, [1.0] * 5) == (pytest.approx(0.8), pytest.approx(1.2), pytest.approx(1.2))
    ratio, noise = timing.paired(down, [1.0] * 5)
    assert ratio == pytest.approx(1.2) and noise == pytest.approx(0.4) and ratio < 1 + noise
    # Rounds where `b` looks much faster widen only the upper bound.
    up = [1.2, 1.2, 1.2, 1.3, 2.5]
    assert timing.paired(up, [1.0] * 5) == (pytest.approx(1.2), timing.NOISE_FLOOR)
    assert timing.bounds(up, [1.0] * 5)[2] == pytest.approx(2.5)
    # Only the rounds both have count; none in common: no evidence either way.
    assert timing.paired([2.0, 2.0, 9.0], [1.0, 1.0])[0] == pytest.approx(2.0)
    assert timing.paired([], [1.0]) == (1.0, 1.0)


def test_more_rounds_narrow_the_bound_where_a_quartile_would_not():
    # The same noisy machine, 10 rounds then 30: the quartile stays where it is, the bound closes in.
    rng = np.random.default_rng(0)
    ratios = 1.25 * np.exp(rng.normal(0, 0.2, 30))
    a, b = list(ratios), [1.0] * 30
    q1 = lambda v: statistics.quantiles(v, n=4, method="inclusive")[0]  # noqa: E731
    noise10, noise30 = timing.paired(a[:10], b[:10])[1], timing.paired(a, b)[1]
    assert noise30 < noise10
    assert abs((np.median(a) - q1(a)) - (np.median(a[:10]) - q1(a[:10]))) < noise10 - noise30
    low, middle, high = timing.bounds(a, b)
    assert low == pytest.approx(sorted(ratios)[timing.bound_rank(30) - 1]) and middle == pytest.approx(np.median(a))
    assert high == pytest.approx(sorted(ratios)[-timing.bound_rank(30)])


def _fake_clock(costs):
    """Calls that each advance a fake clock by their cost; returns `(calls, order, now, clock)`."""
    now, order = [0.0], []

    def timed(key):
        def call():
            order.append(key)
            now[0] += costs[key]
        return call

    return {key: timed(key) for key in costs}, order, now, lambda: now[0]


def test_rounds_interleave_rotate_and_keep_only_what_more_asks_for():
    costs = {"a": 1.0, "b": 1.1, "slow": 3.0}
    calls, order, now, clock = _fake_clock(costs)
    asked = []

    def more(rounds):
        asked.append({key: len(v) for key, v in rounds.items()})
        return ["a", "b"]  # "slow" is settled

    rounds = timing.run_rounds(calls, {"a": 2, "b": 1, "slow": 1}, budget_s=40.0, min_rounds=3, more=more,
                               clock=clock)
    # Seconds per step, whatever the steps per round.
    for key, cost in costs.items():
        assert rounds[key] == pytest.approx([cost] * len(rounds[key]))
    # Rounds rotate; every key has the minimum before `more` is asked at all.
    assert order[:8] == ["a", "a", "b", "slow", "b", "slow", "a", "a"]
    assert asked[0] == {"a": 3, "b": 3, "slow": 3} and len(rounds["slow"]) == 3
    # Then only what `more` asks for, until the budget is spent, within MAX_ROUNDS.
    assert len(rounds["a"]) == len(rounds["b"]) > 3 and "slow" not in order[8 + 4:]
    assert now[0] >= 40.0 or len(rounds["a"]) == timing.MAX_ROUNDS


def test_the_minimum_is_kept_past_the_budget_and_settled_rounds_stop():
    calls, _, now, clock = _fake_clock({"x": 1.0, "y": 1.0})
    rounds = timing.run_rounds(calls, {"x": 1, "y": 1}, budget_s=0.0, min_rounds=4, clock=clock)
    assert [len(v) for v in rounds.values()] == [4, 4]  # a budget spent before the rounds began
    rounds = timing.run_rounds(calls, {"x": 1, "y": 1}, budget_s=1e9, max_rounds=6, clock=clock)
    assert [len(v) for v in rounds.values()] == [6, 6]
    start = now[0]
    rounds = timing.run_rounds(calls, {"x": 1, "y": 1}, budget_s=1e9, min_rounds=5, more=lambda r: [], clock=clock)
    assert [len(v) for v in rounds.values()] == [5, 5] and now[0] - start == 10.0  # settled: stops at once


def test_the_rounds_stop_at_the_hard_limit_whatever_the_minimum():
    now = [0.0]

    def step():
        now[0] += 1.0

    calls = {"a": step, "b": step}
    rounds = timing.run_rounds(calls, {"a": 1, "b": 1}, budget_s=0.0, min_rounds=5, hard_s=3.0,
                               clock=lambda: now[0])
    # Rounds start at 0, 2 and 4 s: the third begins past the 3 s limit, so two rounds ran, not five.
    assert [len(v) for v in rounds.values()] == [2, 2] and now[0] == 4.0
    rounds = timing.run_rounds(calls, {"a": 1, "b": 1}, budget_s=0.0, min_rounds=5, hard_s=0.0,
                               clock=lambda: now[0])
    assert [len(v) for v in rounds.values()] == [1, 1]  # the first round always: every route shows its step
