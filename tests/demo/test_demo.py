"""`python -m kmix demo`: the naive run goes NaN, the kmix run trains like float32."""

import contextlib
import io
import math
import os

import keras
import numpy as np
import pytest

from kmix import demo


def test_data_labels_are_the_strict_majority_marker():
    tokens, labels = demo.make_data(200, seed=3)
    lengths = (tokens != 0).sum(axis=1)
    assert lengths.min() >= demo.MIN_LEN and lengths.max() <= demo.MAX_LEN
    for row, label, length in zip(tokens, labels, lengths):
        assert (row[length:] == 0).all() and (row[:length] != 0).all()
        counts = np.array([(row == marker).sum() for marker in range(1, demo.CLASSES + 1)])
        assert counts[label] > np.delete(counts, label).max()
    again, _ = demo.make_data(200, seed=3)
    np.testing.assert_array_equal(tokens, again)


def test_naive_mask_is_nan_in_float16_and_kmix_matches_float32():
    tokens, _ = demo.make_data(16, seed=0)
    keras.config.set_dtype_policy("float32")
    reference = np.asarray(demo.build_model("naive")(tokens), np.float64)
    keras.config.set_dtype_policy("mixed_float16")
    naive = np.asarray(demo.build_model("naive")(tokens), np.float64)
    ours = np.asarray(demo.build_model("kmix")(tokens), np.float64)
    assert np.isfinite(reference).all()
    assert np.isnan(naive).all()
    # Same seed, same weights: only float16 rounding separates them.
    np.testing.assert_allclose(ours, reference, atol=2e-2)
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert np.isfinite(np.asarray(demo.build_model("naive")(tokens))).all()  # -1e9 fits in bfloat16


# The demo's runs cost mostly their builds and compiles (about 13 s each on 2 cores): 20 steps rather than 40
# save a seventh, and still train well past the checks below (loss 2.4 -> 1.6 by step 20).
STEPS = 20


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One demo run of STEPS steps, shared by the tests below, its output captured: stdout is not a terminal."""
    out = tmp_path_factory.mktemp("demo")
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            results = demo.main(["--steps", str(STEPS), "--out", str(out)])
    finally:
        keras.config.set_dtype_policy("float32")
    return results, out, stdout.getvalue(), stderr.getvalue()


def test_demo_naive_run_goes_nan(demo_run):
    results = demo_run[0]
    naive = results["naive"]
    assert naive["first_nan_step"] == 1
    assert all(math.isnan(v) for v in naive["losses"])
    assert math.isnan(naive["final_loss"])
    assert naive["skipped_steps"] == STEPS  # every step skipped: the weights never moved
    assert naive["final_scale"] == pytest.approx(2.0**15 / 2.0**STEPS)  # halved at each


def test_demo_kmix_run_trains_like_float32(demo_run):
    results = demo_run[0]
    f32, ours = results["float32"], results["kmix"]
    assert len(ours["losses"]) == STEPS and all(math.isfinite(v) for v in ours["losses"])
    assert ours["first_nan_step"] is None and f32["first_nan_step"] is None
    assert ours["losses"][-1] < 0.8 * ours["losses"][0]
    assert abs(ours["final_loss"] - f32["final_loss"]) <= 0.1 * f32["final_loss"] + 0.02
    assert abs(ours["accuracy"] - f32["accuracy"]) <= 0.05
    assert ours["final_scale"] == 2.0**15 and ours["skipped_steps"] == 0
    assert len(ours["scales"]) == STEPS


def test_demo_prints_table_and_saves_png(demo_run, capsys):
    results, out = demo_run[:2]
    path = os.path.join(out, "demo.png")
    assert results["plot"] == path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    table = demo.format_results({k: results[k] for k in demo.RUNS}, "mixed_float16")
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["run", "final", "loss"]
    assert "nan" in lines[3] and lines[3].rstrip().endswith("1")
    assert lines[4].rstrip().endswith("none")


def test_demo_help_describes_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--steps", "--policy", "--out", "mixed_bfloat16", "kmix-out"):
        assert option in text


def test_demo_progress_is_compact_without_a_terminal(demo_run):
    _, _, stdout, stderr = demo_run
    lines = (stdout + stderr).splitlines()
    # Reference: Keras's bar redraws per step ("━" and carriage returns); compact mode
    # prints every ceil(STEPS / 10) steps: 10 lines per run, 30 in all.
    assert "━" not in stdout + stderr and "\r" not in stdout + stderr
    step_lines = [line for line in lines if line.lstrip().startswith("step ")]
    every = math.ceil(STEPS / 10)
    assert every > 1  # the lines do thin the steps out
    assert [line.split()[1] for line in step_lines] == [f"{k}/{STEPS}" for k in range(every, STEPS + 1, every)] * 3
    assert "loss scale 32768" in step_lines[-1]  # the kmix run shows its scale


def test_demo_figure_draws_every_legend_entry_and_states_the_conclusion(demo_run):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = {k: demo_run[0][k] for k in demo.RUNS}
    fig = demo.figure(results, "mixed_float16")
    try:
        title = fig.get_suptitle()
        assert "NaN from step 1" in title and "with kmix: trains like float32" in title
        ax_loss, ax_ours, ax_naive = fig.axes
        for ax in fig.axes:
            legend = ax.get_legend()
            for handle, text in zip(legend.legend_handles, legend.get_texts()):
                # Every entry names an artist with something drawn (a finite point).
                lines = [l for l in ax.get_lines() if l.get_label() == text.get_text()]
                assert lines, text.get_text()
                assert np.isfinite(np.asarray(lines[0].get_ydata(), float)).any(), text.get_text()
        assert "-1e9 mask: NaN from step 1" in [t.get_text() for t in ax_loss.get_legend().get_texts()][1]
        # kmix's scale panel is fitted to kmix's scales (2^15 here), not to the naive run's 2^(15 - STEPS).
        low, high = ax_ours.get_ylim()
        scales = np.asarray(results["kmix"]["scales"])
        assert scales.min() / 8 <= low < scales.min() and scales.max() < high <= scales.max() * 8
        # The naive panel reaches down to the naive run's last scale.
        assert ax_naive.get_ylim()[0] <= results["naive"]["scales"][-1]
    finally:
        plt.close(fig)
