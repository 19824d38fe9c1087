"""A `.keras` file from `model.save` holding kmix layers, loaded where kmix is not imported.

What Keras 3.15 does (keras/src/saving/serialization_lib.py): a class is
found by its registered name (`"kmix>MultiHeadAttention"`, present only once
kmix is imported), else, for the modules of `keras`, `keras_hub`,
`keras_cv` and `keras_nlp` only, by importing the `module` the file records;
anything else raises `TypeError: Could not locate class ...`, which the
model's own `from_config` wraps in "<class 'Functional'> could not be
deserialized properly". So an installed kmix is never imported for the file,
and nothing a public API lets the file hold changes that first line. What
the file does hold, and this test keeps: the
`kmix.layers...` module and the `kmix>` registered name, which the message
prints, and a load that works once `import kmix` has run.
"""

import json
import subprocess
import sys
import zipfile

import keras
import numpy as np

import kmix

LOADER = """
import sys, json
import numpy as np
sys.modules["kmix"] = None  # kmix is installed (editable): this hides it, as a machine without it
import keras
path, x = sys.argv[1], np.load(sys.argv[2])
try:
    keras.models.load_model(path)
    without = None
except Exception as e:
    without = {"type": type(e).__name__, "message": str(e)}
del sys.modules["kmix"]
import kmix
out = np.asarray(keras.models.load_model(path)(x))
np.save(sys.argv[3], out)
print(json.dumps({"without": without}))
"""


def test_saved_kmix_layers_name_kmix_and_load_after_import_kmix(tmp_path):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))
    x = kmix.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    model = keras.Model(inputs, kmix.layers.Softmax()(x))
    path = tmp_path / "model.keras"
    model.save(path)
    layers = json.loads(zipfile.ZipFile(path).read("config.json"))["config"]["layers"]
    recorded = {(layer["module"], layer["registered_name"]) for layer in layers[1:]}
    assert recorded == {("kmix.layers.multi_head_attention", "kmix>MultiHeadAttention"),
                        ("kmix.layers.softmax", "kmix>Softmax")}

    sample = np.random.default_rng(0).normal(size=(2, 4, 8)).astype("float32")
    np.save(tmp_path / "x.npy", sample)
    done = subprocess.run(
        [sys.executable, "-c", LOADER, str(path), str(tmp_path / "x.npy"), str(tmp_path / "out.npy")],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    without = json.loads(done.stdout.strip().splitlines()[-1])["without"]
    assert without is not None and without["type"] == "TypeError"
    # Keras's message names the kmix class by its module and registered name (not on its first line).
    assert "Could not locate class 'MultiHeadAttention'" in without["message"]
    assert "kmix.layers.multi_head_attention" in without["message"] and "kmix>MultiHeadAttention" in without["message"]
    # After `import kmix`: the same model, the same outputs.
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), np.asarray(model(sample)))
