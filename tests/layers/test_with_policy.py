"""kmix.layers.WithPolicy: runs a layer under another policy; checked against plain runs."""

import keras
import numpy as np
import pytest

import kmix
from kmix.layers import WithPolicy
from tests.testing import assert_config_round_trip, assert_layer_dtypes, assert_model_round_trip


def dtype_of(x):
    return keras.backend.standardize_dtype(x.dtype)


def layer_norm64(x, gamma, beta, eps):
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def test_float32_island_in_a_float16_model():
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((16,))
    h = keras.layers.Dense(32, name="proj")(inputs)
    norm = WithPolicy(keras.layers.LayerNormalization(epsilon=1e-3, gamma_initializer="random_normal"), "float32")
    out = norm(h)
    assert dtype_of(h) == "float16" and dtype_of(out) == "float32"
    assert {dtype_of(w) for w in norm.weights} == {"float32"}
    assert norm.layer.compute_dtype == "float32"
    model = keras.Model(inputs, [h, out])
    x = np.random.default_rng(0).normal(size=(4, 16)).astype("float32")
    h_val, out_val = model.predict(x, verbose=0)
    gamma, beta = (keras.ops.convert_to_numpy(w) for w in norm.weights)
    # The island normalizes the float16 activations in float32: float64 on the same inputs.
    np.testing.assert_allclose(out_val, layer_norm64(h_val, gamma, beta, 1e-3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["float32", "O1", "O2", "mixed_bfloat16", "p=f32,c=f16,o=f16"])
def test_layer_check(policy):
    assert_layer_dtypes(lambda: WithPolicy(keras.layers.Dense(4), policy), (2, 3))


def test_variables_take_params_dtype_and_output_takes_output_dtype():
    layer = WithPolicy(keras.layers.Dense(4), "O2")  # params float16, output float32
    y = layer(np.ones((2, 3), np.float32))
    assert dtype_of(layer.layer.kernel) == "float16"
    assert dtype_of(y) == "float32"
    layer = WithPolicy(keras.layers.Dense(4), kmix.Policy("O3", half="bfloat16"))
    y = layer(np.ones((2, 3), np.float32))
    assert dtype_of(layer.layer.kernel) == "bfloat16" and dtype_of(y) == "bfloat16"


def test_integer_inputs_pass_through():
    layer = WithPolicy(keras.layers.Embedding(10, 4), "mixed_float16")
    y = layer(np.array([[1, 2, 3]], np.int32))
    assert dtype_of(y) == "float16"
    assert dtype_of(layer.layer.embeddings) == "float32"


def test_multi_input_layer_matches_a_plain_float32_run():
    keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 5, 8)).astype("float32")
    v = rng.normal(size=(2, 7, 8)).astype("float32")
    wrapped = WithPolicy(keras.layers.MultiHeadAttention(2, 4), "float32")
    out = wrapped(q.astype("float16"), v.astype("float16"))
    assert dtype_of(out) == "float32"
    plain = keras.layers.MultiHeadAttention(2, 4, dtype="float32")
    plain(q, v)
    plain.set_weights(wrapped.get_weights())
    expected = plain(q.astype("float16").astype("float32"), v.astype("float16").astype("float32"))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(out), keras.ops.convert_to_numpy(expected), atol=1e-6)


def test_sub_model_runs_under_the_policy():
    inputs = keras.Input((8,))
    block = keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(8, activation="relu")(inputs)))
    x = np.random.default_rng(2).normal(size=(3, 8)).astype("float32")
    expected = keras.ops.convert_to_numpy(block(x))
    wrapped = WithPolicy(block, "mixed_float16")
    y = wrapped(x)
    assert dtype_of(y) == "float16"
    assert all(layer.compute_dtype == "float16" for layer in block.layers[1:])
    assert {dtype_of(w) for w in block.weights} == {"float32"}
    np.testing.assert_allclose(keras.ops.convert_to_numpy(y).astype(np.float32), expected, rtol=1e-2, atol=1e-2)


def test_built_under_another_dtype_is_refused():
    dense = keras.layers.Dense(3, name="built_dense")
    dense(np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match=r"'built_dense'.*float32 variables.*float16.*before it is built"):
        WithPolicy(dense, "float16")
    assert dtype_of(WithPolicy(dense, "mixed_float16")(np.ones((1, 2), np.float32))) == "float16"


def test_bad_arguments():
    with pytest.raises(ValueError, match="do not pass `dtype`"):
        WithPolicy(keras.layers.Dense(2), "float32", dtype="float16")
    with pytest.raises(TypeError, match="keras.layers.Layer"):
        WithPolicy(lambda x: x, "float32")
    with pytest.raises(ValueError, match="'O7'"):
        WithPolicy(keras.layers.Dense(2), "O7")


def test_training_and_mask_are_forwarded():
    drop = WithPolicy(keras.layers.Dropout(0.5, seed=0), "float32")
    x = np.ones((4, 50), np.float32)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(drop(x, training=False)), x)
    assert np.any(keras.ops.convert_to_numpy(drop(x, training=True)) == 0)

    ids = np.array([[1, 2, 0, 0]], np.int32)
    emb = keras.layers.Embedding(5, 3, mask_zero=True)
    pooled = WithPolicy(keras.layers.GlobalAveragePooling1D(), "float32")(emb(ids))
    vectors = keras.ops.convert_to_numpy(emb(ids))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(pooled), vectors[:, :2].mean(1), rtol=1e-6)


def test_config_round_trip():
    layer = WithPolicy(keras.layers.Dense(3), kmix.Policy("O2", half="bfloat16"), name="wp")
    clone = assert_config_round_trip(layer)
    assert clone.policy == layer.policy and clone.name == "wp"
    assert clone.layer.dtype_policy.name == "bfloat16"


def test_model_round_trip_without_custom_objects():
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((6, 8))
    h = keras.layers.Dense(8)(inputs)
    h = WithPolicy(keras.layers.LayerNormalization(), "float32")(h)
    h = WithPolicy(keras.layers.MultiHeadAttention(2, 4), "O2")(h, h)
    model = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(h))
    x = np.random.default_rng(3).normal(size=(2, 6, 8)).astype("float32")
    loaded = assert_model_round_trip(model, x)
    wrappers = [layer for layer in loaded.layers if isinstance(layer, WithPolicy)]
    assert [w.policy for w in wrappers] == [kmix.Policy("float32"), kmix.Policy("O2")]
    assert {dtype_of(w) for w in wrappers[1].weights} == {"float16"}
