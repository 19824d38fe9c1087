"""kmix.layers.MultiHeadAttention: a float64 reference, Keras parity, both paths, masks and bias."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from tests.testing import assert_config_round_trip, assert_layer_dtypes, assert_model_round_trip

B, T, S, D, HEADS, KEY_DIM = 2, 5, 6, 8, 2, 4
RNG = np.random.default_rng(0)
QUERY = RNG.normal(size=(B, T, D)).astype(np.float32)
VALUE = RNG.normal(size=(B, S, D)).astype(np.float32)


def reference(layer, query, value, keep=None, bias=None):
    """Float64 attention from the layer's weights: (output (B, T, D), probabilities (B, N, T, S))."""

    def dense(sub, x):
        w = {v.path.rsplit("/", 1)[-1]: np.asarray(v.numpy(), np.float64) for v in sub.weights}
        return np.einsum(sub.equation, np.asarray(x, np.float64), w["kernel"]) + w.get("bias", 0.0)

    q = dense(layer.query_dense, query) / np.sqrt(layer.key_dim)
    k, v = dense(layer.key_dense, value), dense(layer.value_dense, value)
    scores = np.einsum("btnh,bsnh->bnts", q, k)
    keep_all = np.ones(scores.shape, bool)
    if keep is not None:
        keep_all &= np.broadcast_to(keep[:, None] if keep.ndim == 3 else keep, scores.shape)
    if bias is not None:
        b = np.asarray(bias, np.float64)
        b = np.broadcast_to(b[:, None] if b.ndim == 3 else b, scores.shape)
        keep_all &= b > -1e3
        scores = scores + np.where(b > -1e3, b, 0.0)
    probs = np.zeros_like(scores)
    for idx in np.ndindex(scores.shape[:-1]):
        k_row = keep_all[idx]
        if k_row.any():
            e = np.exp(scores[idx][k_row] - scores[idx][k_row].max())
            probs[idx][k_row] = e / e.sum()
    context = np.einsum("bnts,bsnh->btnh", probs, v)
    return dense(layer.output_dense, context), probs


def make_layer(**kwargs):
    keras.utils.set_random_seed(1)
    layer = kmix.layers.MultiHeadAttention(
        num_heads=HEADS, key_dim=KEY_DIM, bias_initializer="random_normal", **kwargs
    )
    layer(QUERY, VALUE)  # build
    return layer


def _keep():
    keep = RNG.random((B, T, S)) > 0.3
    keep[0, 2] = False  # a query with every key masked
    return keep


def _bias():
    bias = RNG.normal(size=(B, HEADS, T, S)).astype(np.float32)
    bias[RNG.random(bias.shape) < 0.25] = -1e9
    bias[1, :, 3] = -np.inf  # fully masked by the bias
    return bias


CASES = {
    "none": lambda: {},
    "attention_mask": lambda: {"attention_mask": _keep()},
    "bias_btS": lambda: {"attention_bias": np.where(_keep(), RNG.normal(size=(B, T, S)), -1e9).astype(np.float32)},
    "bias_bnts_and_mask": lambda: {"attention_bias": _bias(), "attention_mask": _keep()},
}


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["fused_path", "dropout_path"])
def test_matches_float64_reference_on_both_paths(dropout):
    layer = make_layer(dropout=dropout)
    for name, make_kwargs in CASES.items():
        kwargs = make_kwargs()
        keep, bias = kwargs.get("attention_mask"), kwargs.get("attention_bias")
        expected_out, expected_probs = reference(layer, QUERY, VALUE, keep, bias)
        out = layer(QUERY, VALUE, **kwargs)
        out2, probs = layer(QUERY, VALUE, return_attention_scores=True, training=False, **kwargs)
        for got in (out, out2):
            np.testing.assert_allclose(got, expected_out, atol=2e-5, err_msg=name)
        np.testing.assert_allclose(probs, expected_probs, atol=1e-6, err_msg=name)


def test_equals_keras_where_keras_is_right():
    # float32, no fully masked query: Keras's two paths and kmix agree.
    ours = make_layer()
    theirs = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=KEY_DIM)
    theirs(QUERY, VALUE)
    theirs.set_weights(ours.get_weights())
    keep = RNG.random((B, T, S)) > 0.3
    keep[:, :, 0] = True
    for kwargs in ({}, {"attention_mask": keep}, {"use_causal_mask": True},
                   {"attention_mask": keep, "use_causal_mask": True},
                   {"value_mask": keep[:, 0]}):
        for scores in (False, True):
            a = ours(QUERY, VALUE, return_attention_scores=scores, **kwargs)
            b = theirs(QUERY, VALUE, return_attention_scores=scores, **kwargs)
            for x, y in zip(a if scores else [a], b if scores else [b]):
                np.testing.assert_allclose(x, y, atol=2e-6, err_msg=str((kwargs, scores)))


def test_high_rank_attention_axes_equal_keras():
    x = RNG.normal(size=(2, 3, 4, D)).astype(np.float32)
    keras.utils.set_random_seed(2)
    ours = kmix.layers.MultiHeadAttention(num_heads=HEADS, key_dim=KEY_DIM, attention_axes=(1, 2))
    theirs = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=KEY_DIM, attention_axes=(1, 2))
    ours(x, x), theirs(x, x)
    theirs.set_weights(ours.get_weights())
    mask = RNG.random((2, 3, 4, 3, 4)) > 0.3
    mask[..., 0, 0] = True
    np.testing.assert_allclose(ours(x, x, attention_mask=mask), theirs(x, x, attention_mask=mask), atol=2e-6)


# float16 scores can overflow to -inf and take the full check; bfloat16 ones are zeroed from the mask.
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("scores", [False, True], ids=["fused_path", "explicit_path"])
def test_fully_masked_queries_attend_to_nothing_under_half_policies(scores, policy):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(3)
    layer = kmix.layers.MultiHeadAttention(num_heads=HEADS, key_dim=KEY_DIM)  # zero output bias
    keep = np.ones((B, T, S), bool)
    keep[:, 1] = False
    query = tf.constant(QUERY)
    with tf.GradientTape() as tape:
        tape.watch(query)
        result = layer(query, VALUE, attention_mask=keep, return_attention_scores=scores)
        out = result[0] if scores else result
        loss = tf.reduce_sum(tf.cast(out, tf.float32) ** 2)
    grads = tape.gradient(loss, [query] + layer.trainable_variables)
    assert all(np.all(np.isfinite(tf.cast(g, tf.float32).numpy())) for g in grads)
    # The masked query's output is 0 whatever its query: its gradient is exactly 0.
    np.testing.assert_array_equal(grads[0].numpy()[:, 1], 0.0)
    assert out.dtype == policy.split("_")[1] and np.all(np.isfinite(tf.cast(out, tf.float32).numpy()))
    out = tf.cast(out, tf.float32).numpy()
    np.testing.assert_array_equal(out[:, 1], 0.0)  # zeros, not a mean over padding
    assert np.all(np.abs(out[:, 0]) > 0)
    if scores:
        np.testing.assert_array_equal(tf.cast(result[1], tf.float32).numpy()[:, :, 1], 0.0)
    # Keras's fused path spreads such a query uniformly over the masked keys.
    theirs = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=KEY_DIM)
    theirs(QUERY, VALUE)
    theirs.set_weights(layer.get_weights())
    assert np.abs(theirs(QUERY, VALUE, attention_mask=keep).numpy()[:, 1]).max() > 0


def test_float16_bias_of_minus_inf_equals_the_boolean_mask_and_has_finite_gradients():
    keras.config.set_dtype_policy("mixed_float16")
    layer = make_layer()
    keep = _keep()
    hand_made = (1.0 - keep.astype(np.float32)) * -1e9  # -inf once cast to float16
    by_mask = layer(QUERY, VALUE, attention_mask=keep)
    by_bias = layer(QUERY, VALUE, attention_bias=tf.cast(hand_made, tf.float16))
    np.testing.assert_array_equal(by_bias.numpy(), by_mask.numpy())
    expected, _ = reference(layer, QUERY, VALUE, keep)
    np.testing.assert_allclose(by_bias.numpy().astype(np.float64), expected, atol=2e-2)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.cast(layer(QUERY, VALUE, attention_bias=hand_made), tf.float32) ** 2)
    grads = tape.gradient(loss, layer.trainable_variables)
    assert all(np.all(np.isfinite(g.numpy())) for g in grads)


def test_compiled_call_equals_eager():
    layer = make_layer()
    kwargs = {"attention_mask": _keep(), "attention_bias": _bias()}
    compiled = tf.function(lambda q, v: layer(q, v, **kwargs), jit_compile=True)
    np.testing.assert_allclose(compiled(QUERY, VALUE), layer(QUERY, VALUE, **kwargs), atol=1e-6)


def test_attention_bias_errors_name_the_argument():
    layer = make_layer()
    with pytest.raises(TypeError, match=r"Received: attention_bias\.dtype=bool.*attention_mask"):
        layer(QUERY, VALUE, attention_bias=np.ones((B, T, S), bool))
    with pytest.raises(ValueError, match=r"Received: attention_bias\.shape=\(2, 5, 7\); expected a shape broadcastable to \(2, 2, 5, 6\)"):
        layer(QUERY, VALUE, attention_bias=np.zeros((B, T, S + 1), np.float32))


def test_layer_dtypes():
    value = keras.ops.convert_to_tensor(VALUE)
    assert_layer_dtypes(lambda: kmix.layers.MultiHeadAttention(HEADS, KEY_DIM), (B, T, D), call_kwargs={"value": value})
    assert_layer_dtypes(
        lambda: kmix.layers.MultiHeadAttention(HEADS, KEY_DIM, value_dim=3),
        (B, S, D),
        call_kwargs={"value": value, "return_attention_scores": True, "attention_bias": np.zeros((S, S), np.float32)},
    )


def test_serialization_round_trips():
    layer = kmix.layers.MultiHeadAttention(HEADS, KEY_DIM, value_dim=3, dropout=0.1, name="mha")
    assert_config_round_trip(layer)
    keras.config.set_dtype_policy("mixed_float16")
    x_in = keras.Input((T, D))
    keep_in = keras.Input((T, T), dtype="bool")
    bias_in = keras.Input((T, T))
    out = kmix.layers.MultiHeadAttention(HEADS, KEY_DIM)(x_in, x_in, attention_mask=keep_in, attention_bias=bias_in)
    model = keras.Model([x_in, keep_in, bias_in], out)
    keep = RNG.random((B, T, T)) > 0.3
    bias = np.where(RNG.random((B, T, T)) > 0.2, RNG.normal(size=(B, T, T)), -1e9).astype(np.float32)
    loaded = assert_model_round_trip(model, [QUERY, keep, bias])
    assert type(loaded.layers[-1]) is kmix.layers.MultiHeadAttention


def test_additive_bias_as_attention_mask_raises():
    # Keras's own layer would cast it to bool: it would keep exactly what should be masked.
    layer = make_layer()
    keep = _keep()
    bias = np.where(keep, 0.0, -1e9).astype(np.float32)
    with pytest.raises(ValueError, match=r"attention_mask.*outside \[0, 1\].*`attention_bias=`"):
        layer(QUERY, VALUE, attention_mask=bias)
    # What the user meant: the same values as `attention_bias`.
    _, want = reference(layer, QUERY, VALUE, bias=bias)
    _, got = layer(QUERY, VALUE, attention_bias=bias, return_attention_scores=True)
    np.testing.assert_allclose(got, want, atol=1e-5)

    def call(mask):
        return layer(QUERY, VALUE, attention_mask=mask)

    with pytest.raises(tf.errors.InvalidArgumentError, match="attention_bias="):
        tf.function(call)(bias)
    assert np.isnan(tf.function(call, jit_compile=True)(bias).numpy()).all()
    # A 0/1 float mask is the boolean mask, on every path.
    want, _ = reference(layer, QUERY, VALUE, keep=keep)
    for f in (call, tf.function(call), tf.function(call, jit_compile=True)):
        np.testing.assert_allclose(f(keep.astype(np.float32)), want, atol=1e-5)


def test_keep_mask_as_attention_bias_warns():
    layer = make_layer()
    with pytest.warns(UserWarning, match=r"attention_bias holding only 0 and 1.*`attention_mask=`"):
        layer(QUERY, VALUE, attention_bias=_keep().astype(np.float32))


def test_rank_two_masks_are_read_by_the_documented_rule():
    """Issue 39 item 6: (B, S) is a key mask, (T, S) is shared over the batch; compared with float64 NumPy."""
    layer = make_layer()
    key = RNG.random((B, S)) > 0.3
    full = np.broadcast_to(key[:, None, None, :], (B, HEADS, T, S))
    _, probs = layer(QUERY, VALUE, attention_mask=key, return_attention_scores=True)
    np.testing.assert_allclose(np.asarray(probs), reference(layer, QUERY, VALUE, keep=full)[1], atol=1e-5)
    causal = np.tril(np.ones((T, S), bool))
    bias = np.where(causal, 0.0, -1e9).astype(np.float32)
    _, probs = layer(QUERY, VALUE, attention_bias=bias, return_attention_scores=True)
    expected = reference(layer, QUERY, VALUE, keep=np.broadcast_to(causal, (B, HEADS, T, S)))[1]
    np.testing.assert_allclose(np.asarray(probs), expected, atol=1e-5)


def test_rank_two_mask_that_reads_two_ways_is_refused():
    layer = make_layer()
    query = RNG.normal(size=(T, T, D)).astype(np.float32)  # batch == T: (T, S) could be either reading
    value = RNG.normal(size=(T, S, D)).astype(np.float32)
    with pytest.raises(ValueError, match=r"attention_mask.*broadcasts two ways.*attention_mask\[:, None, :\]"):
        layer(query, value, attention_mask=np.ones((T, S), bool))


def test_rank_two_key_mask_with_the_causal_mask_is_a_key_mask():
    """Keras ands `attention_mask` with the causal mask as NumPy broadcasts; kmix reads (B, S) as keys first."""
    layer = make_layer()
    key = RNG.random((B, S)) > 0.3
    _, probs = layer(QUERY, VALUE, attention_mask=key, use_causal_mask=True, return_attention_scores=True)
    causal = np.tril(np.ones((T, S), bool))
    full = np.broadcast_to((causal[None] & key[:, None, :])[:, None], (B, HEADS, T, S))
    np.testing.assert_allclose(np.asarray(probs), reference(layer, QUERY, VALUE, keep=full)[1], atol=1e-5)
