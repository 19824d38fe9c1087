"""No placement makes a finite value non-finite; variables a layer makes float32 on purpose stay float32.

References: the float32 model's own predictions (float64 NumPy where exact), and what Keras's own
half policies make of the same layers when built under them.
"""

import os

import keras
import numpy as np
import pytest

import kmix


def _biased_model():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="proj")(inputs)
    big = keras.layers.Dense(3, name="big")
    out = keras.layers.Dense(2, name="head")(big(h) * 1e-3)
    model = keras.Model(inputs, out)
    big.bias.assign(np.array([1e5, -2e5, 1.0], "float32"))  # finite, beyond float16's 65504
    return model


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_variable_beyond_float16_stays_float32(level):
    model = _biased_model()
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(x))
    with pytest.warns(UserWarning, match=r"kept \['big'\] in float32.*65504"):
        _, table = kmix.autocast(model, level, return_table=True)
    row = {r.layer: r for r in table}["big"]
    assert row.after == "float32" and "does not fit float16" in row.reason
    assert model.get_layer("big").bias.dtype == "float32"
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.get_layer("big").bias)[:2], [1e5, -2e5])
    got = keras.ops.convert_to_numpy(model(x))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, atol=5e-2 * np.abs(expected).max())
    # Back to float32: the values are the ones the user had.
    kmix.autocast(model, "O0")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(model.get_layer("big").bias)[:2], [1e5, -2e5])


def test_bfloat16_holds_them_in_half():
    model = _biased_model()
    _, table = kmix.autocast(model, "O2-bfloat16", return_table=True)
    assert {r.layer: r for r in table}["big"].after == "bfloat16"


class Scaled(keras.layers.Layer):
    """A layer with a half-typed kernel and a scale it makes float32 on purpose."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 4), name="w")
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale", dtype="float32")

    def call(self, x):
        return keras.ops.matmul(x, self.w) * keras.ops.cast(self.scale, self.compute_dtype)


def _lora_model(policy=None):
    with kmix.policy_scope(policy or "float32"):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,), dtype="int32")
        layers = [keras.layers.Embedding(50, 8, name="emb"), keras.layers.Dense(8, name="dense"), Scaled(name="scaled"),
                  keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 4), name="einsum")]
        h = inputs
        for layer in layers:
            h = layer(h)
        model = keras.Model(inputs, keras.layers.Dense(3, name="head")(h))
    for name in ("emb", "dense", "einsum"):
        model.get_layer(name).enable_lora(2)
    return model


def _dtypes(model):
    return {v.path: keras.backend.standardize_dtype(v.dtype) for v in model.weights}


@pytest.mark.skipif(tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 15),
                    reason="holds for Keras >= 3.15, which creates LoRA adapters in float32 (earlier: the layer's dtype)")
@pytest.mark.parametrize("level, keras_policy", [("O2-bfloat16", "bfloat16"), ("O3-bfloat16", "bfloat16"),
                                                 ("O2", "float16")])
def test_lora_and_fixed_float32_variables_stay_float32(level, keras_policy, tmp_path):
    model = _lora_model()
    _, table = kmix.autocast(model, level, return_table=True)
    dtypes = _dtypes(model)
    # Keras's own half policy, the model built under it: the reference for every variable but
    # the layers kmix keeps float32 by its rules (none here: head hands float32 out from half).
    reference = _dtypes(_lora_model(keras_policy))
    for path, dtype in dtypes.items():
        if "lora_" in path or path.endswith("scale"):
            assert dtype == "float32", path
        assert dtype == reference[path], (path, dtype, reference[path])
    why = {r.layer: r.reason for r in table}
    assert "lora_kernel_a, lora_kernel_b kept float32" in why["dense"]
    # A reload makes them so too, and predicts bit for bit what trained.
    x = np.random.default_rng(0).integers(0, 50, size=(3, 6)).astype("int32")
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"Scaled": Scaled})
    assert _dtypes(loaded) == dtypes
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(model(x)))
