"""`python -m kmix bench train`: FLOP count, batch search, ratios, and a quick end-to-end run."""

import functools
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix.benchmarks import gpt, routes, train, train_rounds, train_table
from tests.testing import full_only


def _rec(policy="mixed_bfloat16", jit=False):
    return kmix.Recommendation(policy, jit, ("measured",), policy == "mixed_float16", None)


def test_configurations_in_table_order():
    assert train.configurations(train.POLICIES, ["auto"], _rec()) == [
        ("float32", "keras", "auto"),
        ("mixed_bfloat16", "keras", "auto"),
        ("mixed_float16", "keras", "auto"),
        ("float32", "tf-rewrite", False),
        ("float32", "kmix", "auto"),
        ("mixed_bfloat16", "kmix", "auto"),
        ("mixed_float16", "kmix", "auto"),
        ("mixed_bfloat16", "recommended", False),
    ]
    # recommend(model)'s route is the last row.
    assert train.configurations(["float32"], [True], _rec(), _rec("float32", True))[-2:] == [
        ("mixed_bfloat16", "recommended", False), ("float32", "recommend(model)", True)]
    # Both compilations: every keras and kmix row twice, the rewrite and the recommendation once.
    assert len(train.configurations(train.POLICIES, [False, True], _rec())) == 14
    assert train.configurations(["mixed_bfloat16"], [True]) == [("mixed_bfloat16", "keras", True),
                                                               ("mixed_bfloat16", "kmix", True)]


def test_the_control_row_is_the_first_float32_keras_route_again():
    configs = train.configurations(["float32", "mixed_bfloat16"], [False], control=True)
    assert configs[:3] == [("float32", "keras", False), ("mixed_bfloat16", "keras", False),
                           ("float32", "keras-again", False)]
    assert ("float32", "keras-again", False) not in train.configurations(["mixed_bfloat16"], [False], control=True)


def _row(stack, rounds, phase=0):
    return {"policy": "float32", "stack": stack, "jit_compile": False, "rounds": tuple(rounds),
            "step_seconds": float(np.median(rounds)), "peak_bytes": None, "phase": phase}


def test_the_control_line_says_whether_the_same_route_measured_alike():
    rng = np.random.default_rng(0)
    base = 0.2 * (1 + 0.01 * rng.standard_normal(12))
    same = base * (1 + 0.01 * rng.standard_normal(12))
    assert "the same within the noise" in train_table.control_line([_row("keras", base), _row("keras-again", same)])
    # A stretch at 1.5x the time hitting the control's rounds only (the machine slowed under it).
    slowed = same * np.where(np.arange(12) < 9, 1.5, 1.0)
    line = train_table.control_line([_row("keras", base), _row("keras-again", slowed)])
    assert "NOT the same within the noise" in line and "0.6" in line, line
    assert train_table.control_line([_row("keras", base)]) == ""
    assert train_table.control_line([_row("keras", base, None), _row("keras-again", same, None)]) == ""


def test_the_benchmark_datasets_run_without_tf_datas_autotuning_thread():
    """A short `fit` on an autotuned dataset may return at the tuning thread's next wake-up (rounds snapped to
    10 * (2**k - 1) ms): every dataset the speed benchmarks time is built without it."""
    size = {"batch": 2, "seq": 4, "vocab": 16, "image": 32, "classes": 3}
    datasets = [gpt.make_dataset(2, 4, 16), routes._image_data(size), routes._token_data("gpt2-lm", size),
                routes._token_data("bert", size)]
    for data in datasets:
        assert data.options().autotune.enabled is False
        assert data.map(lambda x, y: x).options().autotune.enabled is False  # bench predict's inputs
    assert tf.data.Dataset.range(3).options().autotune.enabled is not False  # TensorFlow's default: on


@pytest.mark.parametrize("stack", ["keras", "kmix"])
def test_model_flops_per_token_against_a_hand_count(stack):
    layers, d, heads, seq, vocab = 2, 16, 2, 8, 40
    model = gpt.build_model(layers, d, heads, seq, vocab, stack)
    # Per block: 2 LayerNorms (4d), Q/K/V/output projections with biases
    # (4d^2 + 4d), MLP d -> 4d -> d (8d^2 + 5d); then the final LayerNorm and the head.
    n = layers * (12 * d * d + 13 * d) + 2 * d + d * vocab + vocab
    assert sum(int(w.numpy().size) for w in model.trainable_weights) == n + vocab * d + seq * d
    assert gpt.model_flops_per_token(model, layers, d, seq) == 6 * n + 12 * layers * d * seq


@pytest.mark.parametrize(
    "threshold, start, limit, expected",
    [
        (37, 2, 2**16, None),  # doubling to 64 fails, bisection between 32 and 64
        (3, 8, 2**16, 3),  # the starting batch already fails
        (10**9, 4, 16, (16, True)),  # never fails below the limit
        (64, 64, 2**16, None),  # exactly the start
    ],
)
def test_largest_batch_doubles_then_bisects(monkeypatch, threshold, start, limit, expected):
    tried = []

    def fake_fits(policy, stack, size, batch):
        tried.append(batch)
        return batch <= threshold

    monkeypatch.setattr(train_rounds, "fits", fake_fits)
    batch, capped = train_rounds.largest_batch("mixed_bfloat16", "kmix", {}, start, limit)
    if expected is not None and capped:
        assert (batch, capped) == expected
        return
    assert not capped
    if expected is not None:
        assert batch == expected
    assert batch <= threshold and batch >= threshold * 15 / 16  # within 1/16 below the limit
    assert len(tried) == len(set(tried))  # no batch is tried twice


def test_format_rows_ratios_against_the_float32_keras_row():
    def result(policy, stack, jit, seconds, peak, tflops=1.0):
        return {"policy": policy, "stack": stack, "jit_compile": jit, "step_seconds": seconds,
                "tokens_per_second": 100 / seconds, "tflops": tflops, "peak_bytes": peak, "loss": 1.0}

    rows = train_table.format_rows([
        result("float32", "keras", False, 0.4, 2**31),
        result("mixed_bfloat16", "kmix", False, 0.1, 2**30),
        result("float32", "keras", True, 0.2, 2**31),
        result("mixed_bfloat16", "recommended", True, 0.05, 2**29, tflops=None),
    ])
    # Every ratio is against the first float32 Keras row (Keras's default compile).
    assert [r[-2] for r in rows] == [1.0, 4.0, 2.0, 8.0]
    assert [r[-1] for r in rows] == [1.0, 0.5, 1.0, 0.25]
    assert rows[1][6] == "1.00 GiB" and rows[3][6] == "512.0 MiB"
    assert rows[3][5] == "n/a"


def test_quick_run_prints_every_route(tmp_path, capsys, monkeypatch):
    """Every route of the quick run is in the table, in order, with consistent figures, and the plot is written.

    The device probe leaves XLA out (its `limit_s`, as a tight `recommend` budget does): the recommended routes
    are then tf.function ones, not two XLA compiles of the GPT (~8 s of CPU each) that this test does not check
    (bench gpu's test trains an XLA route; bench predict's times one)."""
    monkeypatch.setattr(kmix.device, "probe", functools.partial(kmix.device.probe, limit_s=0.0))
    path = str(tmp_path / "train.png")
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        out = train.main(["--quick", "--no-tf32", "--max-batch", "--plot", path])
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
        keras.config.set_dtype_policy("float32")
    text = capsys.readouterr().out
    assert "TF32 off" in text
    rec, model_rec = out["recommendation"], out["model_recommendation"]
    assert isinstance(rec, kmix.Recommendation) and str(rec) in text
    # recommend(model): its table of routes on this model, and its row against Keras's and the fastest.
    # Under load the quick run's 3 s budget may cover no build: then the reasons say so (no table).
    assert str(model_rec) in text
    assert model_rec.table is not None or "not measured on your model" in str(model_rec) or "budget_s" in model_rec.reasons[-1]
    assert "kmix.recommend(model) chose" in text and "Keras's default float32 compile" in text
    expected = train.configurations(train.POLICIES, ["auto"], rec, model_rec)
    auto_jit = bool(tf.config.list_physical_devices("GPU"))  # Keras's "auto": XLA only with a GPU
    resolved = [(p, s, auto_jit if j == "auto" else j) for p, s, j in expected]
    assert [(r["policy"], r["stack"], r["jit_compile"]) for r in out["results"]] == resolved
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["policy", "stack"])
    table = lines[header + 2: header + 2 + len(expected)]
    assert [line.split()[:3] for line in table] == [
        [p, s, "XLA" if j else "tf.function"] for p, s, j in resolved
    ]
    assert "auto_mixed_precision" in text  # the rewrite row says which option it set
    for r in out["results"]:
        assert r["step_seconds"] > 0 and r["tokens_per_second"] > 0 and r["tflops"] > 0
        assert math.isfinite(r["loss"])
        # tokens/s and TFLOP/s are the same step time seen two ways.
        assert r["tokens_per_second"] == pytest.approx(2 * 16 / r["step_seconds"])
    for row in out["rows"]:
        assert row[3] > 0 and row[4] > 0 and row[5] > 0 and row[7] > 0
    if not tf.config.list_physical_devices("GPU"):
        assert all(r["peak_bytes"] is None for r in out["results"])
        assert out["max_batch"] == {}
        assert "not meaningful on a CPU" in text
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert out["plot"] == path and os.path.exists(path)
    # The rewrite was on only while its route ran.
    assert not tf.config.optimizer.get_experimental_options().get(routes.rewrite_option(), False)


def test_speedup_is_round_by_round_within_a_phase():
    def result(rounds, phase):
        return {"step_seconds": float(np.median(rounds)), "rounds": rounds, "phase": phase}

    # The machine slowed down in the last rounds for both: the ratio holds at 2.
    base, row = result([2.0, 2.0, 6.0, 6.0, 6.0], 0), result([1.0, 1.0, 3.0, 3.0, 3.0], 0)
    assert train_table.speedup(base, row) == pytest.approx(2.0)
    # Rows timed apart (the rewrite's phase, or each alone): the ratio of the medians.
    assert train_table.speedup(base, result([1.0, 1.0, 3.0, 3.0, 3.0], 1)) == pytest.approx(6.0 / 3.0)
    assert train_table.speedup(result([2.0] * 3, None), result([1.0, 4.0, 4.0], None)) == pytest.approx(0.5)


def test_summary_line_against_keras_and_the_fastest_row():
    def result(policy, stack, jit, seconds):
        return {"policy": policy, "stack": stack, "jit_compile": jit, "step_seconds": seconds}

    line = train_table.summary_line([result("float32", "keras", False, 0.4), result("mixed_bfloat16", "kmix", False, 0.2),
                               result("mixed_bfloat16", "recommend(model)", False, 0.25)])
    assert line == ("kmix.recommend(model) chose mixed_bfloat16, tf.function: 1.60x Keras's default float32 "
                    "compile, 0.80x the fastest row (mixed_bfloat16, kmix, tf.function) in this table.")
    assert train_table.summary_line([result("float32", "keras", False, 0.4)]) == ""


@full_only("about 23 s on 2 cores; the quick run above measures interleaved")
def test_measure_alone_and_interleaved_give_the_same_figures_shape():
    size = {"layers": 1, "d_model": 16, "heads": 2, "seq": 8, "batch": 2, "vocab": 32}
    config = ("float32", "keras", False)
    alone = train_rounds.measure(config, size, steps=2, rounds=2)
    size["image"], size["classes"] = 32, 10
    together = train_rounds.measure_all([config, ("mixed_bfloat16", "kmix", False)], size, 2, 2, interleave=True)
    assert [r["policy"] for r in together] == ["float32", "mixed_bfloat16"]
    for r in [alone, *together]:
        assert set(r) == {"policy", "stack", "jit_compile", "step_seconds", "tokens_per_second",
                          "tflops", "peak_bytes", "loss", "rounds", "phase"}
        assert r["step_seconds"] == pytest.approx(float(np.median(r["rounds"]))) and len(r["rounds"]) == 2
        assert r["step_seconds"] > 0 and math.isfinite(r["loss"])
        assert r["tokens_per_second"] == pytest.approx(16 / r["step_seconds"])
    # Same seed, same batch, same number of steps: float32 trains to the same loss either way.
    assert together[0]["loss"] == pytest.approx(alone["loss"], rel=1e-5)
    assert together[0]["peak_bytes"] is None  # interleaved runs share the device
    assert alone["phase"] is None and together[0]["phase"] == together[1]["phase"] == 0
    if not tf.config.list_physical_devices("GPU"):
        assert alone["peak_bytes"] is None
    else:
        assert alone["peak_bytes"] > 0


def test_plot_states_the_result_and_writes_the_ratio_on_each_bar(tmp_path):
    def result(policy, stack, jit, seconds, peak=None):
        return {"policy": policy, "stack": stack, "jit_compile": jit, "step_seconds": seconds,
                "tokens_per_second": 100 / seconds, "peak_bytes": peak, "rounds": (seconds,) * 3, "phase": None}

    results = [result("float32", "keras", False, 0.4), result("mixed_bfloat16", "keras", False, 0.25),
               result("float32", "kmix", True, 0.32), result("O1-bfloat16", "recommend(model)", False, 0.2)]
    # The title: the recommended route against Keras's float32 default, and against the fastest row.
    assert train_table.headline(results) == ("kmix.recommend(model) picks O1-bfloat16, tf.function: 2.00x the "
                                             "speed of Keras's default float32")
    fig = train_table.figure(results, subtitle="a GPT; on a CPU")
    ax = fig.axes[0]
    # Every bar is labelled in full and carries its ratio, 0.4 s over its step time.
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["float32, keras, tf.function", "mixed_bfloat16, keras, tf.function", "float32, kmix, XLA",
                      "O1-bfloat16, recommend(model), tf.function"]
    on_bars = sorted(t.get_text().strip() for t in ax.texts)
    assert on_bars == sorted(["1.00x (baseline)", "1.60x", "1.25x", "2.00x"])
    assert [round(p.get_width(), 6) for p in ax.patches] == [1.0, 1.6, 1.25, 2.0]
    assert fig._suptitle.get_text() == train_table.headline(results)
    path = train_table.plot(results, str(tmp_path / "speed.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # Without a recommend(model) row, the probe's pick; without any, the fastest row.
    probe_row = results[:3] + [result("O1-bfloat16", "recommended", False, 0.32)]
    assert train_table.headline(probe_row) == ("kmix.recommend() picks O1-bfloat16, tf.function: 1.25x the speed of "
                                               "Keras's default float32 (0.78x the fastest route)")
    assert train_table.headline(results[:3]) == ("The fastest route: mixed_bfloat16, keras, tf.function: 1.60x the "
                                                 "speed of Keras's default float32")
