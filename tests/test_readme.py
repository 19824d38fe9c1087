"""The README's runnable examples, verbatim: every ```python block that starts with an import."""

import pathlib
import re
import runpy

import keras

import kmix
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if b.startswith("import ")]


def test_the_readme_has_runnable_examples():
    assert len(BLOCKS) >= 2  # "Use" and "Custom training loop"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs_verbatim(index, capsys, tmp_path):
    # From a file, as a user would run it (AutoGraph reads the source of `tf.function`s).
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(BLOCKS[index])
    namespace = runpy.run_path(str(script))
    out = capsys.readouterr().out
    if "rec = kmix.recommend()" in BLOCKS[index]:
        rec = namespace["rec"]
        assert f"Recommended: policy {rec.policy!r}" in out
        model, x = namespace["model"], namespace["x"]
        # The placed model computes in the recommended dtype and keeps its outputs float32.
        assert keras.backend.standardize_dtype(model(x[:4]).dtype) == "float32"
        compute = {layer.compute_dtype for layer in model.layers if layer.weights}
        expected = kmix.Policy(rec.policy).compute_dtype
        assert expected in compute
        assert model.optimizer.overflow_report() == []
