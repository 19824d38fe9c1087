"""`python -m kmix bench recommend`: the scoring against hand-timed medians, and one trial on a tiny encoder."""

import math

import pytest

from kmix.benchmarks import recommend


def _run(pick, strict, hand, tie=False, load=3.2):
    return {"load": load, "pick": list(pick), "strict_pick": list(strict), "tie": tie,
            "rounds": {"float32, tf.function": 5, "O1-bfloat16, tf.function": 9}, "hand_ms": hand}


HAND = {"float32, tf.function": 378.0, "float32, XLA": 420.0, "O1-bfloat16, tf.function": 166.0,
        "O1-bfloat16, XLA": 400.0}


def test_scores_and_summary_against_the_hand_timed_fastest():
    good = _run(("O1-bfloat16", False), ("O1-bfloat16", False), HAND)
    kept = _run(("O1-bfloat16", False), ("float32", False), HAND, tie=True)
    near = _run(("float32", False), ("float32", False), {**HAND, "O1-bfloat16, tf.function": 370.0})
    assert recommend.score(good) == {"median": 1.0, "float32": 1.0}
    assert recommend.score(kept) == {"median": 1.0, "float32": pytest.approx(378 / 166)}
    assert recommend.score(near)["median"] == pytest.approx(378 / 370)  # 2% slower: within 5%
    rows, lines = recommend.summarize([good, kept, near])
    assert [r[7] for r in rows] == ["yes", "yes", "yes"] and rows[1][4] == "yes" and rows[0][3] == "5-9"
    assert rows[2][5] == "O1-bfloat16, tf.function" and rows[0][1] == "3.2"
    assert lines[0].startswith("tie='median' (recommend default): within 5% of the fastest hand-timed route in "
                               "3 of 3 runs;")
    assert lines[1].startswith("tie='float32': within 5% of the fastest hand-timed route in 2 of 3 runs; "
                               f"slower in 1, by {378 / 166 - 1:.0%} at worst")


def test_one_trial_on_a_tiny_encoder_hand_times_every_route():
    size = {"blocks": 1, "d_model": 8, "heads": 2, "seq": 4, "vocab": 16, "classes": 2}
    # float32's two routes only: the rest of the trial is the same for any dtypes, at half the compiling.
    # budget_s: room for the first build's estimate (24 eager forward passes) under load, where one pass of even
    # this encoder took 88 ms beside another test run (2 s left none: no route, an exit).
    run = recommend.trial(size, batch_size=4, budget_s=8.0, hand_rounds=2, hand_steps=1, dtypes=["float32"])
    # Every route recommend timed was hand-timed too, and had at least the documented minimum of rounds.
    assert set(run["hand_ms"]) == set(run["rounds"]) == set(run["recommend_ms"])
    # The documented minimum of rounds where routes are compared; one where the budget built one route alone.
    assert min(run["rounds"].values()) >= (5 if len(run["rounds"]) > 1 else 1)
    assert recommend._label(run["pick"]) in run["hand_ms"]
    assert recommend._label(run["strict_pick"]) in run["hand_ms"]
    assert all(math.isfinite(v) and v > 0 for v in run["hand_ms"].values())
