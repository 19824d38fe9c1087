"""`kmix._timing`: interleaved rounds and the statistics `kmix.recommend` decides from."""

import statistics

import pytest

from kmix import _timing


def test_spread_and_paired_against_hand_computed_values():
    # Quartiles of (1, 2, 3, 4, 5), inclusive: 2 and 4; IQR 2 over the median 3.
    assert _timing.spread([5, 1, 4, 2, 3]) == pytest.approx(2 / 3)
    assert _timing.spread([7.0]) == 0.0
    a = [1.0, 1.2, 2.0]  # a machine that slows down: both slow alike
    b = [0.5, 0.6, 1.0]
    ratio, noise = _timing.paired(a, b)
    assert ratio == pytest.approx(2.0) and noise == _timing.NOISE_FLOOR  # the drift cancels out
    # Unpaired, the same figures look noisy: the median of each moves with the drift.
    assert _timing.spread(a) > 0.3
    c = [1.0, 1.5, 1.0, 1.5]
    ratio, noise = _timing.paired(c, [1.0] * 4)
    q1 = statistics.quantiles(c, n=4, method="inclusive")[0]
    assert ratio == pytest.approx(1.25) and noise == pytest.approx(1.25 - q1)  # the lower quartile, 1.0
    # Noise is what could make `b` no faster: rounds where it looks much faster do not count.
    up = [1.2, 1.2, 1.2, 1.3, 2.5]
    assert _timing.paired(up, [1.0] * 5) == (pytest.approx(1.2), _timing.NOISE_FLOOR)
    down = [1.2, 1.2, 1.2, 0.8, 0.9]
    ratio, noise = _timing.paired(down, [1.0] * 5)
    assert ratio == pytest.approx(1.2) and noise == pytest.approx(0.3) and ratio < 1 + noise
    # A configuration pruned early has fewer rounds: only the rounds both have count.
    assert _timing.paired([2.0, 2.0, 9.0], [1.0, 1.0])[0] == pytest.approx(2.0)


def test_rounds_interleave_rotate_and_prune(monkeypatch):
    # A fake clock: each call of a key takes its cost in "seconds".
    costs = {"a": 1.0, "b": 1.1, "slow": 3.0}
    now, order = [0.0], []
    monkeypatch.setattr(_timing.time, "perf_counter", lambda: now[0])

    def timed(key):
        def call():
            order.append(key)
            now[0] += costs[key]
        return call

    calls = {key: timed(key) for key in costs}
    rounds = _timing.run_rounds(calls, {"a": 2, "b": 1, "slow": 1}, budget_s=40.0)
    # Seconds per step, whatever the steps per round.
    for key, cost in costs.items():
        assert rounds[key] == pytest.approx([cost] * len(rounds[key]))
    # Two rounds of everyone, the second rotated; then "slow" (3x the fastest) is timed no more.
    assert order[:8] == ["a", "a", "b", "slow", "b", "slow", "a", "a"]
    assert len(rounds["slow"]) == 2 and "slow" not in order[8:]
    # Rounds go on until the budget is spent (each later round costs 3.1 s), within MAX_ROUNDS.
    assert len(rounds["a"]) == len(rounds["b"]) and 3 <= len(rounds["a"]) <= _timing.MAX_ROUNDS
    assert now[0] >= 40.0 or len(rounds["a"]) == _timing.MAX_ROUNDS


def test_rounds_respect_min_and_max():
    calls = {"x": lambda: None, "y": lambda: None}
    rounds = _timing.run_rounds(calls, {"x": 1, "y": 1}, budget_s=0.0, min_rounds=4, prune=None)
    assert [len(v) for v in rounds.values()] == [4, 4]
    rounds = _timing.run_rounds(calls, {"x": 1, "y": 1}, budget_s=60.0, max_rounds=6, prune=None)
    assert [len(v) for v in rounds.values()] == [6, 6]
