"""`kmix.benchmarks.common`: the helpers every benchmark shares, against hand-made expectations."""

import argparse

import pytest

from kmix.benchmarks import common


def _raise(error):
    raise error


def test_measured_turns_an_error_into_its_row_and_lets_interrupts_through():
    assert common.measured(lambda: {"x": 1}, name="a") == {"x": 1}
    row = common.measured(lambda: _raise(MemoryError("OOM when allocating\nsecond line")), name="a")
    assert row == {"name": "a", "error": "MemoryError: OOM when allocating"}
    long = common.measured(lambda: _raise(ValueError("x" * 400)))["error"]
    assert len(long) == 300 and long.startswith("ValueError: xxx") and long.endswith("...")
    with pytest.raises(KeyboardInterrupt):
        common.measured(lambda: _raise(KeyboardInterrupt()))


def test_alternate_times_each_once_a_round_in_turn_and_rotates():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    rounds = []
    times = common.alternate(fns, 3, warmup=1, after_round=lambda r, t: rounds.append((r, len(t["a"]))))
    # Round 0: each warmed up once, then timed; rounds 1 and 2 without warm-up.
    assert calls == ["a", "a", "b", "b", "c", "c"] + list("abc") * 2
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3} and rounds == [(0, 1), (1, 2), (2, 3)]
    calls.clear()
    common.alternate(fns, 3, warmup=0, rotate=True)
    assert calls == list("abc") + list("bca") + list("cab")


def test_size_arguments_quick_sizes_and_their_checks():
    parser = argparse.ArgumentParser()
    common.add_size_arguments(parser, layers=2, d_model=8, heads=2, image=64, steps=5)
    parser.add_argument("--quick", action="store_true")
    assert common.check_sizes(parser, parser.parse_args([])) == {"layers": 2, "d_model": 8, "heads": 2, "image": 64}
    args = parser.parse_args(["--quick"])
    assert common.check_sizes(parser, args) == {"layers": 1, "d_model": 16, "heads": 2, "image": 32}
    assert args.steps == 2
    for bad in (["--heads", "3"], ["--layers", "0"], ["--image", "16"]):
        with pytest.raises(SystemExit):
            common.check_sizes(parser, parser.parse_args(bad))
    assert common.choices(parser, "--x", "a, b", ("a", "b", "c")) == ["a", "b"]
    with pytest.raises(SystemExit):
        common.choices(parser, "--x", "a,d", ("a", "b"))


def test_format_bytes_and_the_resident_set():
    assert [common.format_bytes(n) for n in (None, 0, 2**29, 3 * 2**30)] == ["n/a", "n/a", "512.0 MiB", "3.00 GiB"]
    now = common.rss()  # read first: another thread may grow the resident set between the two reads
    assert common.peak_rss() >= now > 0  # Linux: /proc/self/status


def test_a_fresh_process_returns_its_json_or_raises_with_its_log():
    assert common.in_fresh_process("json", "dumps", {"obj": [1, 2]}) == "[1, 2]"
    with pytest.raises(RuntimeError, match="exit status 1"):
        common.in_fresh_process("json", "loads", {"s": "not json"})
