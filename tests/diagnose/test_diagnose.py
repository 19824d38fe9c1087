"""`kmix.diagnose`: findings checked against references computed another way."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix import demo
from kmix.__main__ import main


def _overflow_model():
    """x -> Dense "big" (weights within float16, outputs beyond 65504) -> LayerNormalization -> BatchNormalization -> Dense."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, kernel_initializer=keras.initializers.RandomNormal(stddev=1.5e4, seed=1),
                           name="big")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.BatchNormalization(name="bn")(h)
    outputs = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def _state(model):
    return [v.numpy().copy() for v in model.variables + model.optimizer.variables]


def test_overflow_before_normalization_is_the_first_nonfinite_and_a_float32_layer():
    model = _overflow_model()
    model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    before, policy = _state(model), keras.config.dtype_policy().name
    d = kmix.diagnose(model, x, y, batches=2, batch_size=32, bfloat16_available=False)

    # The model, its optimizer and the global policy are as they were.
    for a, b in zip(before, _state(model)):
        np.testing.assert_array_equal(a, b)  # BatchNormalization's moving statistics included
    assert keras.config.dtype_policy().name == policy
    for layer in model.layers:
        assert layer.dtype_policy.name == "float32" and "call" not in vars(layer)

    # Reference: the Dense output in float64 NumPy, and its values that are inf in float16.
    kernel, bias = (w.numpy().astype(np.float64) for w in model.get_layer("big").weights)
    h = x.astype(np.float64) @ kernel + bias
    big = next(r for r in d.layers if r.path == "big")
    np.testing.assert_allclose(big.output.max_abs, np.abs(h).max(), rtol=1e-5)
    with np.errstate(over="ignore"):
        overflowing = np.isinf(h.astype(np.float16)).sum()
    assert 0 < overflowing < h.size
    assert big.output.overflow == overflowing and big.output.size == h.size
    assert d.first_nonfinite_layer == "big"
    assert d.float32_layers[0] == "big" and "norm" in d.float32_layers  # norm receives the overflow
    assert str(d.recommended_policy.name) == "O1-float16"
    assert any(line.startswith("big (Dense): outputs reach") for line in d.findings)

    # float32_layers is what kmix.autocast takes: with it the O1 copy is finite, without it NaN.
    def half_run(**kwargs):
        copy = kmix.autocast(model, "O1", copy=True, **kwargs)
        return np.asarray(copy(x[:32], training=False), np.float64)

    reference = np.asarray(model(x[:32], training=False), np.float64)
    assert not np.isfinite(half_run()).all()
    np.testing.assert_allclose(half_run(float32_layers=d.float32_layers), reference, rtol=2e-2, atol=2e-2)
    # With bfloat16 tensor cores the overflow points to bfloat16 instead (the data from a tf.data.Dataset).
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    assert kmix.diagnose(model, dataset, batches=1, bfloat16_available=True).recommended_policy.name == "mixed_bfloat16"
    # And bfloat16, with float32's range, has nothing to fix here and needs no loss scale.
    bf16 = kmix.diagnose(model, dataset, policy="mixed_bfloat16", batches=1)
    assert bf16.first_nonfinite_layer is None and bf16.float32_layers == [] and bf16.recommended_scale == 1.0


def test_demo_mask_flags_the_attention_layers_and_suggests_masked_softmax(tmp_path, capsys):
    d = main_diagnosis(tmp_path)  # `python -m kmix diagnose --demo`
    out = capsys.readouterr().out
    assert d.first_nonfinite_layer == "attention0"
    assert d.float32_layers == ["attention0", "attention1"]
    masks = [f for f in d.findings if "MaskedSoftmax" in f]
    assert [f.split(" ")[0] for f in masks] == ["attention0", "attention1"]
    assert "feeds a softmax" in masks[0] and "attention0" in out and "FIRST NON-FINITE" in out
    # Reference: float16 really is NaN from attention0 on, and finite just before it.
    tokens, _ = demo.make_data(demo.BATCH, seed=0)
    with kmix.policy_scope("mixed_float16"), np.errstate(over="ignore"):
        half = demo.build_model("naive")
    before = keras.Model(half.input, half.get_layer("ln_a0").output)
    after = keras.Model(half.input, half.get_layer("attention0").output)
    assert np.isfinite(np.asarray(before(tokens), np.float32)).all()
    with np.errstate(over="ignore"):  # -1e9 becomes -inf as the model runs
        assert np.isnan(np.asarray(after(tokens), np.float32)).all()
    # The PNG is written and not blank.
    import matplotlib.image

    image = matplotlib.image.imread(d.plot_path)
    assert image.shape[0] > 300 and image.shape[1] > 800 and image[..., :3].std() > 0.05

    # The same encoder with kmix.layers.MaskedSoftmax: nothing to report.
    with kmix.policy_scope("float32"):
        safe = demo.build_model("kmix")
    safe.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    tokens, labels = demo.make_data(16, seed=2)
    clean = kmix.diagnose(safe, tokens, labels, batches=1, batch_size=16)
    assert clean.first_nonfinite_layer is None and clean.float32_layers == []
    assert clean.findings[-1].startswith("Nothing alarming")


def main_diagnosis(tmp_path):
    from kmix.diagnose import cli

    return cli.main(["--demo", "--batches", "1", "--out", str(tmp_path)])


def test_diagnose_subcommand_is_routed(capsys):
    with pytest.raises(SystemExit) as info:
        main(["diagnose", "--help"])
    assert info.value.code == 0
    assert "--demo" in capsys.readouterr().out


def test_underflowing_gradients_and_the_recommended_scale():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(inputs))
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 16)).astype("float32")
    pred = np.asarray(model(x), np.float64)
    y = (pred + rng.normal(scale=2e-7, size=pred.shape)).astype("float32")  # residuals of ~1e-7
    d = kmix.diagnose(model, x, y, batches=2, batch_size=32)

    # Reference: the same gradients by hand in float64 (mse: 2 (pred - y) / n), flushed by a float16 cast.
    kernel, bias = (w.numpy().astype(np.float64) for w in model.weights)
    grads = []
    for b in range(2):
        xb, yb = x[32 * b:32 * (b + 1)].astype(np.float64), y[32 * b:32 * (b + 1)].astype(np.float64)
        g_out = 2.0 * (xb @ kernel + bias - yb) / len(xb)
        grads += [g_out.ravel(), (xb.T @ g_out).ravel(), g_out.sum(axis=0)]
    g = np.abs(np.concatenate(grads))

    def flushed(scale):
        return ((g * scale).astype(np.float16) == 0).sum() / (g > 0).sum()

    assert flushed(1.0) > 0.5  # most gradients underflow at scale 1
    assert d.underflow_fraction(1.0) == pytest.approx(flushed(1.0), abs=1.5 / g.size)
    scale = d.recommended_scale
    # The largest power of two keeping the largest gradient 8x below 65504, capped at 2^24.
    assert scale == 2.0 ** min(math.floor(math.log2(65504 / (8 * g.max()))), 24)
    assert d.underflow_fraction(scale) == pytest.approx(flushed(scale), abs=1.5 / g.size)
    assert d.underflow_fraction(scale) < 0.05 < d.underflow_fraction(1.0)

    # The next step in float16 at that scale does not overflow: no skipped step, finite weights that moved.
    with kmix.policy_scope("mixed_float16"):
        inputs16 = keras.Input((16,))
        half = keras.Model(inputs16, keras.layers.Dense(1)(inputs16))
        half.set_weights(model.get_weights())
        opt = kmix.wrap(keras.optimizers.SGD(1.0), initial_scale=scale, dynamic=False)
        half.compile(optimizer=opt, loss="mse")
    opt.build(half.trainable_variables)  # built before the step: one trace of it, not two
    half.train_on_batch(x[:32], y[:32])
    assert int(opt.skipped_steps) == 0
    moved = half.get_weights()[0] - model.get_weights()[0]
    assert np.isfinite(moved).all() and np.abs(moved).max() > 0


def test_keras_hub_gpt2_finds_nothing_alarming():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=16, dropout=0.0)
    lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    lm.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tokens = np.random.default_rng(0).integers(1, 64, size=(8, 16)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens, dtype=bool)}
    d = kmix.diagnose(lm, x, np.roll(tokens, -1, axis=1), batches=1, batch_size=8)
    assert d.first_nonfinite_layer is None and d.float32_layers == []
    assert d.recommended_policy == kmix.Policy("mixed_float16")
    assert d.findings[-1].startswith("Nothing alarming")
    paths = [r.path for r in d.layers]
    # Nested layers are recorded: inside the backbone's transformer layers' attention.
    assert any(p.startswith("gpt2_backbone/transformer_layer_0/self_attention/") for p in paths)
    # Reference: the backbone's output, computed directly.
    row = next(r for r in d.layers if r.path == "gpt2_backbone")
    expected = np.abs(np.asarray(backbone(x, training=True))).max()
    np.testing.assert_allclose(row.output.max_abs, expected, rtol=1e-5)


class _Block(keras.layers.Layer):
    """A custom block: a Dense whose outputs exceed 65504, scaled, then normalized."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, kernel_initializer=keras.initializers.RandomNormal(stddev=1e4, seed=2),
                                        name="dense")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.norm.build(tuple(input_shape[:-1]) + (8,))

    def call(self, x):
        return self.norm(self.dense(x) * 10.0)


def test_nested_layers_are_named_as_autocast_takes_them():
    keras.utils.set_random_seed(0)
    i = keras.Input((4,))
    big = keras.layers.Dense(8, kernel_initializer=keras.initializers.RandomNormal(stddev=4e4, seed=1), name="big")
    inner = keras.Model(i, big(i), name="inner")
    x_in = keras.Input((4,))
    h = _Block(name="block")(keras.layers.LayerNormalization(name="ln")(inner(x_in)))
    model = keras.Model(x_in, keras.layers.Dense(1, name="head")(h))
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    d = kmix.diagnose(model, x, np.zeros((32, 1), "float32"), batches=1)
    paths = [r.path for r in d.layers]
    assert paths == ["inner", "inner/big", "ln", "block", "block/dense", "block/norm", "head"]
    assert d.first_nonfinite_layer == "inner/big"
    # big is named inside its nested model; the block's sub-layers are reached through the block.
    assert d.float32_layers == ["big", "ln", "block"]
    reference = np.asarray(model(x), np.float64)
    assert not np.isfinite(np.asarray(kmix.autocast(model, "O1")(x))).all()
    fixed = np.asarray(kmix.autocast(model, "O1", float32_layers=d.float32_layers)(x), np.float64)
    np.testing.assert_allclose(fixed, reference, rtol=2e-2, atol=2e-2)


class _AddOne(keras.layers.Layer):
    """Adds a float32 constant, whatever the input's dtype: what breaks under float16."""

    def call(self, x):
        return x + tf.constant(1.0)


def test_a_layer_that_raises_in_float16_is_named():
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, name="d")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(_AddOne(name="add_one")(h)))
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 3), "float32")
    with kmix.policy_scope("mixed_float16"), pytest.raises(Exception):  # the reference: it does raise
        _AddOne()(keras.ops.ones((2, 3), "float16"))
    d = kmix.diagnose(model, x, np.ones((8, 1), "float32"), batches=1)
    assert d.half_error[0] == "add_one" and d.float32_layers == ["add_one"]
    assert any(line.startswith("add_one (_AddOne) raises under mixed_float16") for line in d.findings)
    assert all("call" not in vars(layer) for layer in model.layers)  # probes removed after the error


@pytest.mark.parametrize("change, error, words", [
    ({"model": "uncompiled"}, ValueError, "`model` must be compiled"),
    ({"x": "narrow"}, ValueError, "`x` does not fit"),
    ({"y": "short"}, ValueError, "`x` and `y` must hold the same number"),
    ({"policy": "float32"}, ValueError, "`policy` must compute in float16 or bfloat16"),
    ({"policy": "O7"}, ValueError, "Unknown policy spec"),
    ({"batches": 0}, ValueError, "`batches` must be an int >= 1"),
    ({"x": "dataset"}, ValueError, "`y` must be None"),
    ({"x": "strings"}, TypeError, "`x` must be NumPy arrays"),
    ({"model": "half"}, ValueError, "`model` must compute in float32"),
])
def test_bad_input_names_the_argument(change, error, words):
    def build():
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
        return model

    model = build()
    if change.get("model") == "half":
        with kmix.policy_scope("mixed_float16"):
            model = build()
    if change.get("model") != "uncompiled":
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 2), "float32")
    kwargs = {"x": x, "y": y, "policy": change.get("policy", "mixed_float16"), "batches": change.get("batches", 1)}
    if change.get("x") == "narrow":
        kwargs["x"] = np.ones((8, 5), "float32")
    elif change.get("x") == "dataset":
        kwargs["x"] = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    elif change.get("x") == "strings":
        kwargs["x"] = ["a", "b"]
    if change.get("y") == "short":
        kwargs["y"] = y[:5]
    with pytest.raises(error, match=words.replace("(", r"\(")):
        kmix.diagnose(model, **kwargs)
