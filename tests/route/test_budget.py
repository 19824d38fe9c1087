"""`kmix.recommend` under a budget it cannot fill: the order it builds in, the probe's fallback, the advice.

The order and the decision are pure functions, tested on injected figures (a probe's GFLOP/s, a table's
rounds); one small call on a real model checks that the call builds in that order, keeps its budget and
says what it measured. Each figure a reason quotes is recomputed here by hand.
"""

import dataclasses
import re
import time

import numpy as np
import pytest

import kmix
from kmix import device
from kmix.route import rule, trials
from kmix.route.recommendation import decide, decide_routes

CPU_BF16 = {"model": "AMD EPYC", "source": "/proc/cpuinfo", "avx512_bf16": True, "amx_bf16": False,
            "avx512_fp16": False, "avx512f": True}
F32, F32_XLA, BF16, BF16_XLA = ("float32", False), ("float32", True), ("O1-bfloat16", False), ("O1-bfloat16", True)
ROUTES = [F32, F32_XLA, BF16, BF16_XLA]  # as recommend lists them: policy by policy


def _probe(f32, bf16, f16=(1.0, 1.0)):
    """A Probe from `(tf.function, XLA)` GFLOP/s pairs per dtype."""
    figures = {}
    for dtype, (plain, xla) in (("float32", f32), ("bfloat16", bf16), ("float16", f16)):
        figures[(dtype, False)], figures[(dtype, True)] = float(plain), float(xla)
    return device.Probe("CPU (test)", (1024, 512, 2048), figures, 2.0)


# (name, probe, default_jit, the order)
ORDERS = [
    # AVX512_BF16 (design.md's CPU 1): bfloat16 fastest as a tf.function, XLA slower for both.
    ("bf16 CPU", _probe((120, 110), (210, 100)), False, [F32, BF16, F32_XLA, BF16_XLA]),
    # AVX2 only (CPU 3): XLA 3x faster; float32's reference is its XLA route, bfloat16's best is XLA too.
    ("AVX2 CPU", _probe((40, 125), (35, 120)), False, [F32_XLA, BF16_XLA, F32, BF16]),
    # float32's other compilation (98) outranks the best half route (90): the half route is built first.
    ("half before float32's second", _probe((100, 98), (90, 80)), False, [F32, BF16, F32_XLA, BF16_XLA]),
    # Within the noise floor float32's reference is Keras's default compilation (XLA with a GPU).
    ("GPU", _probe((50e3, 51e3), (400e3, 420e3)), True, [F32_XLA, BF16_XLA, BF16, F32]),
]


@pytest.mark.parametrize("name, probe, default_jit, order", ORDERS, ids=[o[0] for o in ORDERS])
def test_routes_are_built_in_the_order_the_probe_ranks_them(name, probe, default_jit, order):
    assert rule.build_order(ROUTES, probe, default_jit) == order
    # A prefix of the order is what a budget that covers that many builds times: its first half route is
    # always the probe's best (the highest GFLOP/s of any half route).
    best_half = max((r for r in ROUTES if r[0] != "float32"), key=lambda r: probe.rate("bfloat16", r[1]))
    assert order[1] == best_half


def test_without_a_probe_kerass_default_compilation_comes_first():
    assert rule.build_order(ROUTES, None, False) == [F32, BF16, F32_XLA, BF16_XLA]
    assert rule.build_order(ROUTES, None, True) == [F32_XLA, BF16_XLA, F32, BF16]
    assert rule.build_order([F32, F32_XLA], _probe((40, 125), (1, 1)), False) == [F32_XLA, F32]


def test_before_any_build_a_route_is_estimated_from_a_forward_pass_at_least_a_small_builds_pace():
    probe = _probe((40, 125), (35, 120))  # 2.0 s for 6 configurations: a third of a second each
    per = 2.0 / 6
    # A small model: its forward pass says little, a build costs at least TRACE probe configurations.
    assert trials.first_build(F32, 0.1, probe) == pytest.approx(trials.TRACE * per)
    assert trials.first_build(F32_XLA, 0.1, probe) == pytest.approx(trials.TRACE * per * trials.XLA_BUILD)
    assert trials.first_build(F32_XLA, 50.0, probe) == 50.0  # a large model: from its forward pass
    assert trials.first_build(F32, 0.1, None) == 0.1
    # AVX2: float32's reference is XLA; where only the tf.function build fits, that one goes first.
    order = rule.build_order(ROUTES, probe, False)
    builds = {F32: 3.0, BF16: 3.0, F32_XLA: 9.0, BF16_XLA: 9.0}
    assert trials.fitting_first(order, builds, 10.0) == order
    assert trials.fitting_first(order, builds, 5.0) == [F32, F32_XLA, BF16_XLA, BF16]
    assert trials.fitting_first(order, builds, 1.0) == order  # none fits: recommend builds none


def _table(seconds, order, before_s=6.0, budget_s=10.0, setup_s=2.0, skipped=()):
    """A RouteTable as time_routes returns it: `seconds` `{route: [per round]}` timed, `order` asked for."""
    timings = tuple(trials.RouteTiming(p, j, tuple(seconds[(p, j)]), setup_s, 1) for p, j in ROUTES
                    if (p, j) in seconds)
    over = tuple((trials.label(r), "budget") for r in order if r not in seconds)
    return trials.RouteTable(timings, skipped=skipped, batch="a batch of 16 rows", seconds=before_s + 3.0,
                             over_budget=over, budget_s=budget_s, order=tuple(order), before_s=before_s)


def test_no_half_route_timed_recommends_the_probes_route_and_says_so():
    """The issue's case: the budget built float32 only; the probe ranks bfloat16 first (1.75x)."""
    probe = _probe((120, 110), (210, 100))
    order = rule.build_order(ROUTES, probe, False)
    table = _table({F32: [0.383]}, order)
    rec = decide_routes(table, probe, [], CPU_BF16, True)
    device_rec = decide(probe, [], CPU_BF16, True)
    assert (rec.policy, rec.jit_compile) == (device_rec.policy, device_rec.jit_compile) == ("O1-bfloat16", False)
    assert rec.reasons[:len(device_rec.reasons)] == device_rec.reasons  # the probe's reasons, then why
    text = "\n".join(rec.reasons)
    assert "none timed" not in text and "No half route beats" not in text
    assert "timed float32, tf.function, 383.00 ms a step (the table below, 1 round)" in text
    assert "O1-bfloat16, tf.function; float32, XLA; O1-bfloat16, XLA not built" in text
    assert "this device's probe's, not measured on your model" in text
    # The table shows what was timed; the recommended route was not, so no row carries the mark.
    assert rec.table.chosen is None and rec.table.reference == 0 and "<- recommended" not in str(rec.table)
    # The advice, by hand: 6 s before building, the float32 build (2 s) and 5 rounds of its step, then
    # the three routes not built: the tf.function one at the float32 build's 2 s, the XLA ones, with no
    # XLA build measured, at XLA_BUILD (3) times it; 5 rounds of the slowest step each.
    needed = 6.0 + 2.0 + 5 * 0.383 + (2.0 + 5 * 0.383) + 2 * (3 * 2.0 + 5 * 0.383)
    assert table.needed_s() == pytest.approx(needed)
    assert f"a budget_s of {needed:.0f} s or more" in text and "an XLA compile, not measured here, taken as 3" in text
    # Where the probe itself recommends float32, that is the route, and the table marks the row timed.
    flat = _probe((120, 110), (118, 100))
    rec = decide_routes(_table({F32: [0.383]}, rule.build_order(ROUTES, flat, False)), flat, [], CPU_BF16)
    assert (rec.policy, rec.jit_compile) == ("float32", False) and rec.table.chosen == 0


def test_no_half_route_timed_and_no_probe_keeps_float32_as_timed_and_says_so():
    table = _table({F32: [0.4], F32_XLA: [0.3]}, [F32, BF16, F32_XLA, BF16_XLA])
    rec = decide_routes(table, None, [], CPU_BF16)
    assert (rec.policy, rec.jit_compile) == ("float32", True)  # the faster float32 compilation, timed
    text = "\n".join(rec.reasons)
    assert "No device probe to decide from" in text and "untested against the half routes" in text
    assert "none timed" not in text and rec.table.chosen == rec.table.reference == 1


def test_only_float32_asked_for_says_why_rather_than_none_timed():
    skipped = (("bfloat16", "the probe ran it at 0.50x"), ("float16", "0.30x"))
    rec = decide_routes(_table({F32: [0.4] * 5, F32_XLA: [0.3] * 5}, [F32, F32_XLA], skipped=skipped), None, [],
                        CPU_BF16)
    text = "\n".join(rec.reasons)
    assert rec.policy == "float32" and "none timed" not in text
    assert "No half route was timed: the device's probe ran bfloat16 and float16 too slowly" in text


def test_the_reasons_give_the_rounds_run_where_the_budget_cut_them_short():
    steady = [1.0, 1.01, 0.99]
    short = _table({F32: steady, BF16: [t / 1.5 for t in steady]}, [F32, BF16])
    text = "\n".join(decide_routes(short, None, [], CPU_BF16).reasons)
    assert "2 routes, 3 interleaved rounds each (the table below): fewer than the 5" in text
    assert "the rounds stop at 1.2x budget_s" in text
    full = _table({F32: steady * 2, BF16: [t / 1.5 for t in steady * 2]}, [F32, BF16])
    text = "\n".join(decide_routes(full, None, [], CPU_BF16).reasons)
    assert "6 interleaved rounds each (the table below)." in text and "fewer than" not in text


def _small_model():
    import keras

    inputs = keras.Input((16,))
    h = keras.layers.Dense(32, activation="gelu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.LayerNormalization()(h)))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    return model, x, x[:, :4].argmax(axis=1)


def test_a_small_call_builds_in_the_probes_order_and_keeps_its_budget():
    """One real call: a probe (injected) ranking bfloat16 first, a budget that covers a few builds."""
    model, x, y = _small_model()
    probe = _probe((120, 110), (210, 100), (10, 10))
    budget_s = 6.0
    begin = time.perf_counter()
    rec = kmix.recommend(model, x, y, batch_size=16, budget_s=budget_s, probe=probe, verbose=False)
    took = time.perf_counter() - begin
    table = rec.table
    assert list(table.order) == [F32, BF16, F32_XLA, BF16_XLA]
    timed = [(r.policy, r.jit_compile) for r in table.routes]
    assert set(timed) | set(table.untimed()) == set(ROUTES)
    # Built while the budget lasted, in order: what was timed is the order's first routes (each later one's
    # build is estimated as long as an earlier one's, with less time left).
    assert [r for r in table.order if r in timed] == list(table.order[:len(timed)]) and timed[0] == F32
    if BF16 in timed:  # the decision is the pure one, on the table shown
        again = decide_routes(dataclasses.replace(table, chosen=None), probe, device.gpus(), device.cpu_features(),
                              device.onednn_enabled())
        assert (again.policy, again.jit_compile) == (rec.policy, rec.jit_compile)
    else:  # the budget built float32 only: the probe's route, said so
        assert (rec.policy, rec.jit_compile) == ("O1-bfloat16", False)
        assert any("not measured on your model" in r for r in rec.reasons)
    rounds = min(len(r.seconds) for r in table.routes)
    assert rounds >= trials.MIN_ROUNDS or len(table.routes) == 1 or "fewer than the 5" in str(rec)
    # The rounds stop at 1.2x budget_s: the time left after the builds holds it (the wall clock of the
    # call is a benchmark's, `python -m kmix bench recommend`: a build under load can overrun its estimate).
    rounds_s = sum(sum(r.seconds) * r.steps for r in table.routes)  # each round: `steps` steps at its per-step time
    assert rounds_s <= (1 + trials.OVERRUN) * budget_s, str(rec)
    print(f"recommend(budget_s={budget_s:g}) took {took:.1f} s\n{rec}")


def test_a_budget_too_short_for_one_route_recommends_from_the_probe_and_says_so(monkeypatch):
    """Where one forward pass says a route's build would overrun the budget, nothing is built."""
    model, x, y = _small_model()
    monkeypatch.setattr(trials, "time_routes", lambda *a, **k: pytest.fail("built a route over budget"))
    monkeypatch.setattr(trials, "build_estimate", lambda model, x: (60.0, 2.5))  # a large model's forward pass
    probe = _probe((120, 110), (210, 100), (10, 10))
    rec = kmix.recommend(model, x, y, batch_size=16, budget_s=30, probe=probe, verbose=False)
    device_rec = decide(probe, device.gpus(), device.cpu_features(), device.onednn_enabled())
    assert (rec.policy, rec.jit_compile) == (device_rec.policy, device_rec.jit_compile) and rec.table is None
    note = rec.reasons[-1]
    assert note.startswith("budget_s=30 left "), note
    assert "not enough to build one route on the model (about 60.0 s, estimated as 24 forward passes on the batch " \
           "of 2500 ms" in note
    assert "Recommended from this device's probe instead" in note
    # The advice: the time spent before building again, and 4 builds of 60 s (the routes of float32 and
    # bfloat16, the dtypes the probe ranks worth timing), said to be an estimate.
    needed = re.search(r"Timing every route would take a budget_s of about (\d+) s or more", note)
    assert needed and 240 <= int(needed.group(1)) <= 250 and "estimated, not measured" in note, note

