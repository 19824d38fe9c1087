"""`kmix.export`'s artifacts where they are served: by name, and in a process where kmix cannot be imported.

The fixture exports five small models (a keras-hub classifier with dict
inputs, a functional CNN with batch norm, a two-input two-output model, a
model with kmix's safe layers placed, a Sequential MLP) to a SavedModel and
a `.keras` file each, then starts one Python process whose `import kmix`
fails and whose working directory is outside the repository. It loads the
`.keras` files with `keras.models.load_model`, calls the SavedModels'
`serving_default` by the names Keras's own `model.export` gives the inputs
(as a TF Serving request addresses them) and their `serve` endpoint, on a
batch of another size than the sample's, and tries wrong and missing
names. Every output is compared with the float32 model's predictions.
"""

import io
import json
import os
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix

BF16_RTOL = 0.05  # bfloat16 keeps 8 bits of mantissa: a few roundings on the way give about 1e-2 relative
SAMPLE, SERVED = 8, 5  # the batch export checks on, and the batch served

SERVER = r'''
import json, sys
sys.modules["kmix"] = None  # kmix is installed (editable): this makes `import kmix` fail here
try:
    import kmix  # noqa: F401
except ImportError as error:
    blocked = str(error)
else:
    raise SystemExit("kmix is importable in the serving process")
import keras, keras_hub, numpy as np, tensorflow as tf  # noqa: F401  keras_hub: the classifier's classes

report = {"blocked": blocked}
for name, case in json.load(open("cases.json")).items():
    x = dict(np.load(name + ".npz"))
    names = case["names"]  # the names Keras's model.export gives the inputs, in the model's order
    structure = {"dict": x, "list": [x[n] for n in names], "single": x[names[0]] if names else None}[case["structure"]]
    out = {}
    for i, value in enumerate(keras.tree.flatten(keras.models.load_model(name + ".keras")(structure, training=False))):
        out[f"keras/{i}"] = np.asarray(value)
    served = tf.saved_model.load(name)
    signature = served.signatures["serving_default"]
    by_name = {n: tf.constant(x[n]) for n in names}
    for key, value in signature(**by_name).items():
        out[f"serving_default/{key}"] = value.numpy()
    for i, value in enumerate(keras.tree.flatten(served.serve(structure))):
        out[f"serve/{i}"] = value.numpy()
    np.savez(name + ".out.npz", **out)
    calls = {
        "misspelled": lambda: signature(**{(k + "_typo" if k == names[0] else k): v for k, v in by_name.items()}),
        "missing": lambda: signature(**dict(list(by_name.items())[:-1])),
        "positional": lambda: signature(*by_name.values()),
    }
    errors = {}
    for call, run in calls.items():
        try:
            run()
            errors[call] = None
        except Exception as e:  # noqa: BLE001  reported to the test
            errors[call] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    report[name] = errors
report["kmix_modules"] = [m for m, module in sys.modules.items() if m.split(".")[0] == "kmix" and module is not None]
json.dump(report, open("report.json", "w"))
'''


def classifier():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.DistilBertBackbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                                   intermediate_dim=32, max_sequence_length=16)
    model = keras_hub.models.DistilBertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None)

    def draw(rng, batch):
        mask = np.ones((batch, 12), "int32")
        mask[1:, 9:] = 0  # padded rows
        return {"token_ids": rng.integers(1, 64, (batch, 12)).astype("int32") * mask, "padding_mask": mask}

    return model, draw


def cnn():
    image = keras.Input((16, 16, 3), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same")(image)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    h = keras.layers.BatchNormalization()(keras.layers.Conv2D(16, 3, strides=2)(h))
    h = keras.layers.GlobalAveragePooling2D()(keras.layers.ReLU()(h))
    model = keras.Model(image, keras.layers.Dense(4, activation="softmax", name="probs")(h))
    rng = np.random.default_rng(3)
    for layer in model.layers:  # batch statistics that matter: not the fresh 0 and 1
        if isinstance(layer, keras.layers.BatchNormalization):
            gamma, beta, mean, var = layer.get_weights()
            layer.set_weights([rng.uniform(0.5, 2, gamma.shape), rng.normal(size=beta.shape),
                               rng.normal(scale=0.5, size=mean.shape), rng.uniform(0.5, 2, var.shape)])
    return model, lambda rng, batch: {"image": rng.normal(size=(batch, 16, 16, 3)).astype("float32")}


def two_in_two_out():
    a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(16, activation="relu")(a), b])
    model = keras.Model([a, b], [keras.layers.Dense(3, name="o1")(h), keras.layers.Dense(1, name="o2")(h)])
    return model, lambda rng, batch: {"a": rng.normal(size=(batch, 8)).astype("float32"),
                                      "b": rng.normal(size=(batch, 4)).astype("float32")}


def attention():
    """kmix.autocast swaps in kmix's MultiHeadAttention and Softmax here; the file holds Keras's."""
    seq = keras.Input((6, 8), name="seq")
    h = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name="mha")(seq, seq)
    h, scores = keras.layers.MultiHeadAttention(2, 4, name="scored")(h, h, return_attention_scores=True)
    h = keras.layers.Softmax(name="gates")(keras.layers.Dense(8)(h))
    h = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling1D()(h), keras.layers.Flatten()(scores)])
    model = keras.Model(seq, keras.layers.Dense(3, name="out")(h))
    return model, lambda rng, batch: {"seq": rng.normal(size=(batch, 6, 8)).astype("float32")}


def mlp():
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.LayerNormalization(), keras.layers.Dense(5)])
    return model, None  # its input's name is Keras's (`keras_tensor_N`): the draw is keyed by it below


MODELS = {"classifier": classifier, "cnn": cnn, "two": two_in_two_out, "attention": attention, "mlp": mlp}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Exports every model, serves them in a process without kmix; the results and what to check them by."""
    here = tmp_path_factory.mktemp("served")
    cases, results = {}, {}
    for name, build in MODELS.items():
        keras.utils.set_random_seed(0)
        model, draw = build()
        keras_export = str(here / f"{name}.keras_export")
        model.export(keras_export, format="tf_saved_model", verbose=False)
        signature = tf.saved_model.load(keras_export).signatures["serving_default"]
        names = list(signature.structured_input_signature[1])
        if draw is None:  # the Sequential model: one float input under Keras's name for it
            draw = lambda rng, batch, n=names[0]: {n: rng.normal(size=(batch, 12)).astype("float32")}  # noqa: E731
        names = _in_model_order(model, names)
        rng = np.random.default_rng(1)
        sample, x = draw(rng, SAMPLE), draw(rng, SERVED)
        structure = "list" if len(names) > 1 else "single"
        if not isinstance(model, keras.Sequential) and isinstance(model.input, dict):
            structure = "dict"
        as_called = {"dict": lambda d: d, "list": lambda d: [d[n] for n in names], "single": lambda d: d[names[0]]}
        report = kmix.export(model, [str(here / name), str(here / f"{name}.keras")],
                             sample=as_called[structure](sample), verbose=False)
        np.savez(here / f"{name}.npz", **x)
        cases[name] = {"names": names, "structure": structure}
        results[name] = {
            "expected": [np.asarray(v) for v in keras.tree.flatten(model(as_called[structure](x), training=False))],
            "keras_signature": (signature.structured_input_signature, signature.structured_outputs),
            "report": report,
        }
    (here / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, "-c", SERVER], cwd=here, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((here / "report.json").read_text())
    for name in MODELS:
        results[name]["got"] = dict(np.load(here / f"{name}.out.npz"))
        results[name]["errors"] = report[name]
    return here, results, report


def _in_model_order(model, names):
    """The signature's input names in the order the model lists its inputs."""
    order = [t.name for t in model.inputs]
    return sorted(names, key=lambda n: order.index(n) if n in order else len(order))


def _close(got, expected):
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=BF16_RTOL * np.abs(expected).max())


@pytest.mark.parametrize("name", list(MODELS))
def test_served_without_kmix_by_name_as_float32_predicts(served, name):
    here, results, report = served
    assert "kmix" in report["blocked"] and report["kmix_modules"] == []
    assert not str(here).startswith(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    expected, got = results[name]["expected"], results[name]["got"]
    assert expected[0].shape[0] == SERVED != SAMPLE
    for i, e in enumerate(expected):
        _close(got[f"keras/{i}"], e)  # keras.models.load_model, without kmix
        _close(got[f"serve/{i}"], e)  # the `serve` endpoint, the model's input structure
        _close(got[f"serving_default/output_{i}"], e)  # by name, outputs named as Keras names them
    assert len([k for k in got if k.startswith("serving_default/")]) == len(expected)


@pytest.mark.parametrize("name", list(MODELS))
def test_signature_is_keras_exports_and_no_name_is_guessed(served, name):
    here, results, _ = served
    ours = tf.saved_model.load(str(here / name)).signatures["serving_default"]
    assert (ours.structured_input_signature, ours.structured_outputs) == results[name]["keras_signature"]
    errors = results[name]["errors"]
    names = list(results[name]["keras_signature"][0][1])
    assert errors["misspelled"] is not None and errors["missing"] is not None
    if len(names) > 1:  # one input takes one positional tensor; two are never bound by order
        assert errors["positional"] is not None and "positional" in errors["positional"]
        assert any(n in errors["misspelled"] for n in names)


def test_the_keras_file_holds_keras_classes_computing_as_placed(served):
    here, results, _ = served
    with zipfile.ZipFile(here / "attention.keras") as z:
        config = z.read("config.json").decode()
    assert "kmix" not in config
    layers = {layer["config"]["name"]: layer for layer in json.loads(config)["config"]["layers"]}
    # kmix's attention written as Keras's, in bfloat16 on its fused float32-softmax path (no dropout
    # when serving); the one whose scores the model reads runs in float32; the softmax in float32.
    assert (layers["mha"]["module"], layers["mha"]["config"]["dropout"]) == ("keras.layers", 0.0)
    assert layers["mha"]["config"]["dtype"]["config"]["name"] == "bfloat16"
    assert layers["scored"]["config"]["dtype"]["config"]["name"] == "float32"
    assert layers["gates"]["config"]["dtype"]["config"]["name"] == "float32"
    # Every matrix stays bfloat16 in the file, the float32 layers' too (the head, the scored attention);
    # only the normalization's vectors are float32.
    for name in MODELS:
        with zipfile.ZipFile(here / f"{name}.keras") as z:
            assert "kmix" not in z.read("config.json").decode()
        stored = stored_dtypes(here / f"{name}.keras")
        matrices = {path for path, (dtype, rank) in stored.items() if rank >= 2}
        assert matrices and all(stored[path][0] == "bfloat16" for path in matrices), stored
    assert stored_dtypes(here / "attention.keras")["layers/multi_head_attention_1/query_dense/vars/0"][0] == "bfloat16"


def stored_dtypes(path):
    """`{dataset: (dtype, rank)}` of a `.keras` file's weights, as Keras's H5 store writes them."""
    import h5py

    found = {}
    with zipfile.ZipFile(path) as z, h5py.File(io.BytesIO(z.read("model.weights.h5")), "r") as h5:
        h5.visititems(lambda name, obj: found.__setitem__(name, (
            obj.attrs.get("dtype", str(obj.dtype)), obj.ndim)) if isinstance(obj, h5py.Dataset) else None)
    return found


def test_kmix_only_layers_refuse_the_keras_file_before_writing(tmp_path):
    keras.utils.set_random_seed(0)
    x_in, bias = keras.Input((5, 8), name="x"), keras.Input((5, 5), name="bias")
    h = kmix.layers.MultiHeadAttention(2, 4, name="biased")(x_in, x_in, attention_bias=bias)
    h = kmix.layers.MaskedSoftmax(name="masked")(keras.layers.Dense(8)(h))
    model = keras.Model([x_in, bias], keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(4, 5, 8)).astype("float32"), np.zeros((4, 5, 5), "float32")]
    paths = [str(tmp_path / "served"), str(tmp_path / "model.keras")]
    with pytest.raises(ValueError, match=r"(?s)Keras alone.*attention_bias.*'biased'.*MaskedSoftmax.*'masked'"):
        kmix.export(model, paths, sample=x, verbose=False)
    assert not any(os.path.exists(p) for p in paths)
    kmix.export(model, paths[0], sample=x, verbose=False)  # the SavedModel serves it
    got = tf.saved_model.load(paths[0]).signatures["serving_default"](x=tf.constant(x[0]), bias=tf.constant(x[1]))
    _close(got["output_0"].numpy(), np.asarray(model(x, training=False)))
