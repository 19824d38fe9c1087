"""The README's code blocks, verbatim: every ```python block runs as written, from a file."""

import pathlib
import re
import runpy

import keras
import numpy as np

import kmix
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_every_block_is_a_whole_script():
    assert len(BLOCKS) >= 2  # "Use" and "Attention: the one rule"
    for block in BLOCKS:
        assert block.startswith("import "), block[:80]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_verbatim(index, capsys, tmp_path, monkeypatch):
    # From a file, as a user would run it (AutoGraph reads the source of `tf.function`s),
    # in an empty folder: whatever a block writes stays out of the repository.
    monkeypatch.chdir(tmp_path)
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(BLOCKS[index])
    namespace = runpy.run_path(str(script))
    out = capsys.readouterr().out
    if "kmix.recommend(model, x, y" in BLOCKS[index]:
        rec = namespace["rec"]
        assert f"Recommended: policy {rec.policy!r}" in out
        # The table of the routes it timed; on a machine so busy that the probe took the whole budget, none,
        # and the reasons say so, as the README does (recommend keeps its budget under any load).
        promise = README.read_text()
        assert "the table of the routes it timed" in promise and "covered only its probe" in promise
        if rec.table is not None:
            assert str(rec.table) in out and "ms/step" in out
        else:
            assert "not enough to build one route on the model" in rec.reasons[-1]
        model, x = namespace["model"], namespace["x"]
        # The placed model computes in the recommended dtype and keeps its outputs float32.
        assert keras.backend.standardize_dtype(model(x[:4]).dtype) == "float32"
        compute = {layer.compute_dtype for layer in model.layers if layer.weights}
        assert kmix.Policy(rec.policy).compute_dtype in compute
        assert model.optimizer.overflow_report() == []
    if "MaskedSoftmax()(scores, mask=keep)" in BLOCKS[index]:
        probs = np.asarray(namespace["probs"], np.float64)
        scores = namespace["scores"].astype(np.float64)
        expected = np.exp(scores[0, 0, :2]) / np.exp(scores[0, 0, :2]).sum()  # float64 reference
        np.testing.assert_allclose(probs[0, 0], [*expected, 0, 0], atol=1e-3)
        assert (probs[1] == 0).all()
