"""kmix.ops.float32_out: half in, the activation computed and handed out in float32; a reload keeps it."""

import os

import keras
import numpy as np
import pytest

from kmix.ops import float32_out


def _reference(name, x):
    x = x.astype(np.float64)
    if name == "linear":
        return x
    if name in ("softmax", "log_softmax"):
        e = np.exp(x - x.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)
        return p if name == "softmax" else np.log(p)
    if name == "sigmoid":
        return 1 / (1 + np.exp(-x))
    if name == "tanh":
        return np.tanh(x)
    if name == "relu":
        return np.maximum(x, 0)
    if name == "silu":
        return x / (1 + np.exp(-x))
    if name == "softplus":
        return np.log1p(np.exp(x))
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["linear", "softmax", "log_softmax", "sigmoid", "tanh", "relu", "silu", "softplus"])
def test_float32_out_of_bfloat16_input(name):
    x = np.random.default_rng(0).normal(0, 3, size=(4, 7)).astype("float32")
    half = keras.ops.cast(x, "bfloat16")
    out = float32_out.wrap(name)(half)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    # The activation sees the half input exactly (cast up losslessly) and computes in float32.
    exact = keras.ops.convert_to_numpy(keras.ops.cast(half, "float32"))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(out), _reference(name, exact), rtol=2e-6, atol=2e-6)


def test_wrap_unwrap_and_unknown():
    assert float32_out.wrap(None) is float32_out.float32_linear
    assert float32_out.wrap("swish") is float32_out.float32_silu
    assert float32_out.wrap(float32_out.float32_softmax) is float32_out.float32_softmax
    assert float32_out.unwrap(float32_out.float32_softmax) is keras.activations.softmax
    assert float32_out.wrap(lambda x: x) is None
    assert float32_out.wrap("no_such_activation") is None


def test_dense_reloads_with_its_float32_out_activation(tmp_path):
    inputs = keras.Input((5,))
    dense = keras.layers.Dense(3, activation="softmax", dtype="mixed_bfloat16", name="head")
    model = keras.Model(inputs, dense(inputs))
    dense.activation = float32_out.wrap(dense.activation)
    x = np.random.default_rng(1).normal(size=(2, 5)).astype("float32")
    out = model(x)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.get_layer("head").activation is float32_out.float32_softmax
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(out))
