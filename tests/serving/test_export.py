"""`kmix.export`: half-precision serving artifacts, each checked against the float32 model's predictions."""

import os
import types
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix.serving import NotFiniteError, artifact, export
from tests.testing import created_variables

# bfloat16 keeps 8 bits of mantissa: a few roundings on the way give about 1e-2 relative.
BF16_RTOL = 0.05


def mlp(width=64, classes=10):
    keras.utils.set_random_seed(0)
    x = keras.Input((32,), name="features")
    h = keras.layers.Dense(width, activation="relu")(x)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Dense(width, activation="gelu")(h)
    return keras.Model(x, keras.layers.Dense(classes, activation="softmax", name="probs")(h))


def inputs(shape, seed=1):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def predict(model, x):
    """`model`'s outputs on `x` as NumPy, called once eagerly: a reference needs no `predict` trace."""
    return keras.tree.map_structure(keras.ops.convert_to_numpy, model(x, training=False))


def snapshot(model):
    """What export must leave as it was: weights (bitwise), dtypes, policies."""
    return (
        [(v.path, keras.backend.standardize_dtype(v.dtype), v.numpy().tobytes()) for v in model.weights],
        [(layer.name, type(layer).__name__, layer.dtype_policy.name) for layer in model._flatten_layers()],
    )


def served(path):
    """The SavedModel at `path`, as a server loads it: its `serve` endpoint (the object keeps its variables)."""
    loaded = tf.saved_model.load(path)
    return lambda x: loaded.serve(x)


def checkpoint_dtypes(path):
    reader = tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
    return {k: v for k, v in reader.get_variable_to_dtype_map().items() if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


@pytest.fixture(scope="module")
def wide_mlp(tmp_path_factory):
    """`mlp(width=512)` exported once (the variables the export creates recorded), and Keras's own float32 export."""
    here = tmp_path_factory.mktemp("wide_mlp")
    model = mlp(width=512)
    before = snapshot(model)
    x = inputs((64, 32))
    expected = predict(model, x)
    with created_variables() as variables:  # autocast's weightless twins included: they create none
        report = export(model, str(here / "half"), sample=x, verbose=False)
    after = snapshot(model)
    model.export(str(here / "keras_f32"), format="tf_saved_model", verbose=False)
    return types.SimpleNamespace(
        here=here, x=x, expected=expected, report=report, unchanged=before == after,
        created=[(v.dtype.name, int(np.prod(v.shape))) for v in variables],
        weights=sum(int(np.prod(v.shape)) for v in model.weights), width=512)


def test_functional_savedmodel_half_weights_float32_in_and_out(wide_mlp):
    here, x, expected, report = wide_mlp.here, wide_mlp.x, wide_mlp.expected, wide_mlp.report
    assert wide_mlp.unchanged
    got = served(str(here / "half"))(x)
    assert got.dtype == tf.float32
    got = got.numpy()
    np.testing.assert_allclose(got, expected, atol=BF16_RTOL * np.abs(expected).max())
    assert report.max_abs_diff == pytest.approx(np.abs(got - expected).max(), rel=1e-3, abs=1e-7)
    assert report.top1_agreement == pytest.approx(np.mean(got.argmax(-1) == expected.argmax(-1)))
    assert report.top1_agreement >= 0.9

    # Stored in bfloat16 but the norm's vectors; the output layer computes in half, float32 out.
    dtypes = checkpoint_dtypes(str(here / "half"))
    assert sorted(str(d.name) for d in dtypes.values()).count("float32") == 2  # layer norm gamma, beta
    assert report.stored_in_half == [] and "probs" not in report.float32_layers
    # Against Keras's own float32 export of the same model: at most 0.55x the bytes (Keras stores
    # every variable twice, keras-team/keras#23553; kmix once, so about a quarter).
    ours, keras_f32 = artifact.disk_bytes(here / "half"), artifact.disk_bytes(here / "keras_f32")
    assert ours <= 0.55 * keras_f32
    assert report.disk_bytes[str(here / "half")] == ours
    assert report.weight_bytes <= 0.51 * report.float32_weight_bytes


def test_export_makes_no_float32_copy_of_the_weights(wide_mlp):
    """Counted, not timed: the variables made during export are half (the artifact's weights, made once and
    read back once), never a float32 copy of a weight matrix."""
    created, weights, width = wide_mlp.created, wide_mlp.weights, wide_mlp.width
    float32 = sum(n for dtype, n in created if dtype == "float32")
    half = sum(n for dtype, n in created if dtype == "bfloat16")
    assert float32 <= 4 * width, created  # the norm's vectors, read back: no matrix
    assert half <= 2 * weights, (half, weights)  # the artifact's half weights, and them read back


def test_a_functional_graph_with_keras_ops_nodes_is_served_from_the_half_weights_written(tmp_path):
    """`keras.ops` nodes between layers (a shift, a mean, a reshape): the artifact predicts as float32
    within bfloat16's rounding, and the weights it stores are the model's rounded to bfloat16 bit for bit."""
    keras.utils.set_random_seed(0)
    x_in = keras.Input((8, 16), name="features")
    h = keras.layers.Dense(32, name="proj")(x_in)
    h = keras.ops.relu(h + 3.0)
    h = keras.ops.mean(h, axis=1)
    h = keras.ops.reshape(h, (-1, 4, 8))
    h = keras.layers.LayerNormalization(name="norm")(h)
    model = keras.Model(x_in, keras.layers.Dense(5, name="out")(keras.layers.Flatten()(h)))
    x = inputs((16, 8, 16))
    expected = predict(model, x)
    path = str(tmp_path / "ops")
    report = export(model, path, sample=x, verbose=False)
    got = served(path)(x).numpy()
    np.testing.assert_allclose(got, expected, atol=BF16_RTOL * np.abs(expected).max())
    assert report.max_abs_diff == pytest.approx(np.abs(got - expected).max(), rel=1e-3, abs=1e-7)
    stored = {v.name.split(":")[0]: v.numpy() for v in tf.saved_model.load(path).weights}
    for variable in model.get_layer("proj").weights:  # a half layer's weights, rounded once
        want = tf.cast(variable.value, tf.bfloat16).numpy()
        np.testing.assert_array_equal(stored[variable.path.replace("/", "_")], want)


def test_sequential_to_keras_file_reloads_as_written(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((16, 16, 3)),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Conv2D(128, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])
    x = inputs((16, 16, 16, 3))
    expected = predict(model, x)
    path = str(tmp_path / "half.keras")
    report = export(model, path, sample=x, verbose=False)

    loaded = keras.models.load_model(path)
    got = predict(loaded, x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=BF16_RTOL * np.abs(expected).max())
    assert report.max_abs_diff == pytest.approx(np.abs(got - expected).max(), rel=1e-3, abs=1e-7)
    # The head computed in float32 on bfloat16 weights: Keras's float32 layer holding the bfloat16 values.
    head = loaded.layers[-1]
    assert (head.compute_dtype, head.kernel.dtype) == ("float32", "float32")
    kernel = head.kernel.numpy()
    np.testing.assert_array_equal(kernel, tf.cast(tf.cast(kernel, tf.bfloat16), tf.float32).numpy())
    assert {keras.backend.standardize_dtype(v.dtype) for v in loaded.layers[0].weights} == {"bfloat16"}
    with zipfile.ZipFile(path) as z:
        assert "kmix" not in z.read("config.json").decode()
    model.save(str(tmp_path / "f32.keras"))
    assert os.path.getsize(path) <= 0.55 * os.path.getsize(tmp_path / "f32.keras")


def test_subclassed_model(tmp_path):
    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(64, activation="relu")
            self.norm = keras.layers.LayerNormalization()
            self.head = keras.layers.Dense(5)

        def call(self, x):
            return self.head(self.norm(self.hidden(x)))

    keras.utils.set_random_seed(0)
    model = Net()
    x = inputs((32, 12))
    expected = predict(model, x)
    before = snapshot(model)
    report = export(model, str(tmp_path / "net"), sample=x, verbose=False)
    assert snapshot(model)[:2] == before[:2]
    got = served(str(tmp_path / "net"))(x).numpy()
    np.testing.assert_allclose(got, expected, atol=BF16_RTOL * np.abs(expected).max())
    assert report.max_abs_diff == pytest.approx(np.abs(got - expected).max(), rel=1e-3, abs=1e-7)

    class Unsaveable(keras.Model):  # its constructor refuses the arguments `load_model` passes
        def __init__(self):
            super().__init__()
            self.head = keras.layers.Dense(2)

        def call(self, x):
            return self.head(x)

    unsaveable = Unsaveable()
    unsaveable(x)
    expected = predict(unsaveable, x)
    # A SavedModel serves the model itself (placed in place for the export): no copy, so no config needed.
    export(unsaveable, str(tmp_path / "unsaveable"), sample=x, verbose=False)
    got = served(str(tmp_path / "unsaveable"))(x).numpy()
    np.testing.assert_allclose(got, expected, atol=BF16_RTOL * np.abs(expected).max())
    # A `.keras` file is a copy, written from the config.
    with pytest.raises(ValueError, match="kmix.export writes a placed copy of model"):
        export(unsaveable, str(tmp_path / "unsaveable.keras"), sample=x, verbose=False)
    assert not (tmp_path / "unsaveable.keras").exists()


def test_keras_hub_causal_lm_and_backbone(tmp_path):
    """A GPT-2 causal LM (one decoder block) to a SavedModel and a `.keras` file at once, then its backbone alone."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=128, num_layers=1, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=32)
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 128, (4, 12)).astype("int32"), "padding_mask": np.ones((4, 12), "int32")}
    expected = predict(lm, x)
    report = export(lm, [str(tmp_path / "lm"), str(tmp_path / "lm.keras")], sample=x, verbose=False)
    got = served(str(tmp_path / "lm"))(x).numpy()
    np.testing.assert_allclose(got, expected, atol=BF16_RTOL * np.abs(expected).max())
    assert np.mean(got.argmax(-1) == expected.argmax(-1)) >= 0.9
    reloaded = predict(keras.models.load_model(str(tmp_path / "lm.keras")), x)
    assert np.abs(reloaded - expected).max() <= report.max_abs_diff * (1 + 1e-6)
    # The vocabulary projection is the output: float32 compute, its table stored in bfloat16.
    assert report.stored_in_half == ["gpt2_backbone/token_embedding"]
    # The backbone alone: a dict of inputs drawn from its specs, float32 outputs.
    report = export(backbone, str(tmp_path / "backbone"), verbose=False)
    assert "token_ids" in report.sample and np.isfinite(report.max_abs_diff)
    got = served(str(tmp_path / "backbone"))(x)
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), predict(backbone, x), atol=0.05 * report.max_abs_float32)


def test_a_model_placed_by_autocast_is_served_against_its_float32_self(tmp_path):
    """Placed in place by `kmix.autocast` first, checked on a `tf.data.Dataset` of `(x, y)` batches (its first)."""
    model = mlp()
    x = inputs((64, 32))
    expected = predict(model, x)
    placed = kmix.autocast(model, "O1-bfloat16")
    weights = [w.copy() for w in placed.get_weights()]
    data = tf.data.Dataset.from_tensor_slices((x, np.zeros(64, "int32"))).batch(32)
    report = export(placed, str(tmp_path / "half"), sample=data, verbose=False)
    assert report.sample.startswith("given: (32, 32)")
    assert all(np.array_equal(a, b) for a, b in zip(weights, placed.get_weights()))
    assert placed.get_layer("probs").compute_dtype == "bfloat16"  # its matmul in half, its output float32
    got = served(str(tmp_path / "half"))(x).numpy()
    np.testing.assert_allclose(got, expected, atol=BF16_RTOL * np.abs(expected).max())
    first = np.abs(got[:32] - expected[:32]).max()  # the report's figures are the first batch's
    assert report.max_abs_diff == pytest.approx(first, rel=1e-3, abs=1e-7)
    assert report.top1_agreement >= 0.9


def test_keras_applications_model(tmp_path):
    """keras.applications' MobileNetV2 through its first residual block (strided and zero-padded depthwise
    convolutions, batch norms, ReLU6, an add) under a new head: served as the float32 model predicts, and its
    checkpoint holds every kernel in bfloat16 and the batch norms' vectors in float32, read from the artifact."""
    keras.utils.set_random_seed(0)
    base = keras.applications.MobileNetV2(alpha=0.35, input_shape=(32, 32, 3), weights=None, include_top=False)
    pooled = keras.layers.GlobalAveragePooling2D()(base.get_layer("block_2_add").output)
    model = keras.Model(base.input, keras.layers.Dense(10, name="logits")(pooled))
    x = inputs((8, 32, 32, 3))
    expected = predict(model, x)
    path = str(tmp_path / "mobilenet")
    report = export(model, path, sample=x, verbose=False)
    got = served(path)(x).numpy()
    np.testing.assert_allclose(got, expected, atol=BF16_RTOL * np.abs(expected).max() + 1e-6)
    assert report.stored_in_half == []  # the output layer computes in half too, and hands float32 out

    def stored_as(layer):
        return "float32" if isinstance(layer, keras.layers.BatchNormalization) else "bfloat16"

    want = sorted((stored_as(layer), tuple(v.shape)) for layer in model.layers for v in layer.weights)
    reader = tf.train.load_checkpoint(os.path.join(path, "variables", "variables"))
    shapes = reader.get_variable_to_shape_map()
    stored = sorted((d.name, tuple(shapes[k])) for k, d in reader.get_variable_to_dtype_map().items()
                    if k != "_CHECKPOINTABLE_OBJECT_GRAPH")
    assert stored == want
    float32_bytes = sum(v.numpy().nbytes for v in model.weights)
    half_bytes = sum(int(np.prod(shape)) * (2 if dtype == "bfloat16" else 4) for dtype, shape in want)
    assert (report.weight_bytes, report.float32_weight_bytes) == (half_bytes, float32_bytes)


def test_float16_overflow_is_refused_naming_the_layer_then_kept_in_float32(tmp_path):
    keras.utils.set_random_seed(0)
    x_in = keras.Input((8,))
    h = keras.layers.Dense(16, name="big")(x_in)
    h = keras.layers.LayerNormalization()(h)
    model = keras.Model(x_in, keras.layers.Dense(3, name="out")(h))
    kernel, bias = model.get_layer("big").get_weights()
    model.get_layer("big").set_weights([kernel * 1e5, bias])
    x = inputs((32, 8))
    assert np.abs(model.get_layer("big")(x)).max() > 65504  # float16's largest
    path = str(tmp_path / "f16")
    with pytest.raises(NotFiniteError, match="big") as refused:
        export(model, path, dtype="float16", sample=x, verbose=False)
    assert not os.path.exists(path)
    assert "big" in refused.value.float32_layers
    assert refused.value.diagnosis.first_nonfinite_layer == "big"

    report = export(model, path, dtype="float16", sample=x, float32_layers=refused.value.float32_layers,
                    verbose=False)
    expected = predict(model, x)
    got = served(path)(x).numpy()
    np.testing.assert_allclose(got, expected, atol=0.01 * np.abs(expected).max())
    assert "big" in report.float32_layers


def test_two_inputs_two_outputs_and_an_lstm(tmp_path):
    keras.utils.set_random_seed(0)
    a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Dropout(0.5)(keras.layers.Concatenate()([keras.layers.Dense(16)(a), b]))
    model = keras.Model([a, b], [keras.layers.Dense(3, name="o1")(h), keras.layers.Dense(1, name="o2")(h)])
    x = [inputs((16, 8)), inputs((16, 4), seed=2)]
    report = export(model, str(tmp_path / "two"), verbose=False)  # a sample drawn from both specs
    assert report.stored_in_half == [] and report.top1_agreement is None  # o1, o2: half matmuls, float32 out
    got = served(str(tmp_path / "two"))(x)
    for g, e in zip(got, predict(model, x)):
        assert g.dtype == tf.float32
        np.testing.assert_allclose(g.numpy(), e, atol=BF16_RTOL * np.abs(e).max())

    # Keras cannot rebuild a bfloat16 LSTM from its config (its orthogonal initializer's QR has no
    # bfloat16 kernel): no .keras file, nothing written; the SavedModel serves it.
    seq = keras.Input((10, 6))
    lstm = keras.Model(seq, keras.layers.Dense(2)(keras.layers.LSTM(16)(seq)))
    x = inputs((8, 10, 6))
    with pytest.raises(ValueError, match="Nothing was written"):
        export(lstm, [str(tmp_path / "lstm"), str(tmp_path / "lstm.keras")], sample=x, verbose=False)
    assert not os.path.exists(tmp_path / "lstm") and not os.path.exists(tmp_path / "lstm.keras")
    export(lstm, str(tmp_path / "lstm"), sample=x, verbose=False)
    expected = predict(lstm, x)
    np.testing.assert_allclose(served(str(tmp_path / "lstm"))(x).numpy(), expected,
                               atol=BF16_RTOL * np.abs(expected).max())


def test_bad_input_names_the_argument(tmp_path):
    assert kmix.export is export
    model, path = mlp(), str(tmp_path / "half")
    with pytest.raises(ValueError, match=r"`dtype` must be .*Received: dtype='float32'"):
        export(model, path, dtype="float32")
    with pytest.raises(TypeError, match=r"`filepath` must be a path.*Received: filepath=3"):
        export(model, 3)
    with pytest.raises(TypeError, match=r"`model` must be a keras.Model.*Received: model='model'"):
        export("model", path)
    with pytest.raises(ValueError, match="`model` must be built"):
        export(keras.Sequential([keras.layers.Dense(2)]), path)
    with pytest.raises(ValueError, match=r"`sample` does not fit model"):
        export(model, path, sample=inputs((4, 7)), verbose=False)
    with pytest.raises(TypeError, match=r"`sample` must be a batch of inputs.*Received: sample of type str"):
        export(model, path, sample="x", verbose=False)
    assert not os.path.exists(path)


def test_bad_arguments_are_refused_at_the_call_and_nothing_is_written(tmp_path):
    model, x = mlp(), inputs((8, 32))
    for name in ("model.h5", "model.hdf5"):
        with pytest.raises(ValueError, match=r"`filepath` must be a directory for a SavedModel or a file ending in "
                                             r"'.keras'.*Received: filepath="):
            export(model, str(tmp_path / name), sample=x, verbose=False)
    with pytest.raises(ValueError, match=r"`sample` must hold at least one row.*Received: sample with shapes \(0, 32\)"):
        export(model, str(tmp_path / "empty"), sample=x[:0], verbose=False)
    assert sorted(os.listdir(tmp_path)) == []


def test_an_int64_sample_of_token_ids_is_taken_as_the_models_int32(tmp_path):
    ids = keras.Input((6,), dtype="int32", name="ids")
    h = keras.layers.Embedding(50, 16)(ids)
    model = keras.Model(ids, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))
    x = np.random.default_rng(0).integers(0, 50, (8, 6)).astype("int64")
    expected = predict(model, x.astype("int32"))
    export(model, str(tmp_path / "ids"), sample=x, verbose=False)
    got = served(str(tmp_path / "ids"))(x.astype("int32")).numpy()
    np.testing.assert_allclose(got, expected, atol=BF16_RTOL * np.abs(expected).max())
    with pytest.raises(ValueError, match=r"`sample` must hold int32 values .*Received: sample of dtype int64"):
        export(model, str(tmp_path / "big"), sample=x + 2**40, verbose=False)
    with pytest.raises(ValueError, match=r"`sample` must hold int32 values .*Received: sample of dtype float32"):
        export(model, str(tmp_path / "floats"), sample=x.astype("float32"), verbose=False)
    assert sorted(os.listdir(tmp_path)) == ["ids"]


def test_a_failed_read_back_leaves_nothing_behind(tmp_path, monkeypatch):
    model, x = mlp(), inputs((8, 32))
    load, read_saved_model = artifact.load, artifact.read_saved_model

    def wrong(path, served_model):  # a .keras file rebuilt so that it computes otherwise
        call, seconds = load(path, served_model)
        return (lambda inputs_: call(inputs_) * 0 + 1.0), seconds

    def moved(path):  # a SavedModel whose weights read back are not those written
        call, weights = read_saved_model(path)
        weights[0].assign(weights[0] + tf.cast(1.0, weights[0].dtype))
        return call, weights

    monkeypatch.setattr(artifact, "load", wrong)
    monkeypatch.setattr(artifact, "read_saved_model", moved)
    with pytest.raises(ValueError, match="read back it is .* and was removed"):
        export(model, str(tmp_path / "half.keras"), sample=x, verbose=False)
    with pytest.raises(ValueError, match="read back its weights are not the bfloat16 weights it wrote"):
        export(model, str(tmp_path / "half"), sample=x, verbose=False)
    assert sorted(os.listdir(tmp_path)) == []
    np.testing.assert_array_equal(predict(model, x), predict(mlp(), x))  # left as it was
