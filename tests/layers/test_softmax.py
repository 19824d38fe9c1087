"""kmix.layers.Softmax and MaskedSoftmax: Keras's behaviours, float32 compute, the NaN failure."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from tests.testing import assert_config_round_trip, assert_layer_dtypes, assert_model_round_trip


def float64_softmax(x, keep, axis=-1):
    """Softmax over the kept entries in float64; masked entries and empty rows give 0."""
    x = np.asarray(x, np.float64)
    keep = np.broadcast_to(keep, x.shape)
    z = np.where(keep, x, -np.inf)
    m = np.max(z, axis=axis, keepdims=True)
    e = np.where(keep, np.exp(z - np.where(np.isfinite(m), m, 0)), 0.0)
    s = e.sum(axis=axis, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


# Keras's own Softmax tests (keras/src/layers/activations/softmax_test.py), same numbers.


def test_keras_correctness():
    x = np.array([[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]])
    expected = np.array([[0.21194157, 0.5761169, 0.21194157]] * 2)
    np.testing.assert_allclose(kmix.layers.Softmax()(x), expected, rtol=1e-6)
    np.testing.assert_allclose(kmix.layers.Softmax(axis=1)(x), expected, rtol=1e-6)


def test_keras_correctness_with_mask_and_tuple_axis():
    x = np.array([[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]])
    mask = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    expected = np.array([[0.21194154, 0.0, 0.21194154], [0.0, 0.57611686, 0.0]])
    got = kmix.layers.Softmax(axis=(1, 0))(x, mask=mask)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(got, keras.layers.Softmax(axis=(1, 0))(x, mask=mask), rtol=1e-6)


def test_keras_masked_values_are_zero_including_fully_masked():
    x = np.array([[1.0, 2.0, 5.0, 1.0], [1.0, 1.0, 1.0, 1.0], [3.0, 1.0, 2.0, 4.0]], np.float32)
    mask = np.array([[True, True, False, False], [False] * 4, [True] * 4])
    expected = np.array(
        [[0.268941, 0.731059, 0.0, 0.0], [0.0] * 4, [0.236883, 0.032059, 0.087144, 0.643914]]
    )
    got = kmix.layers.Softmax()(x, mask=mask).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-6)
    np.testing.assert_array_equal(got[~mask], 0.0)
    np.testing.assert_allclose(got, keras.layers.Softmax()(x, mask=mask), atol=1e-7)


@pytest.mark.parametrize("mask", [np.array([[1.0, 0.0, 1.0]]), np.array([1.0, 0.0, 1.0])], ids=["1x3", "3"])
def test_keras_broadcastable_masks(mask):
    x = np.array([[1.0, 2.0, 1.0], [3.0, 4.0, 5.0]])
    got = kmix.layers.Softmax()(x, mask=mask).numpy()
    np.testing.assert_allclose(got[:, 1], [0.0, 0.0])
    np.testing.assert_allclose(got, float64_softmax(x, mask > 0.5), atol=1e-7)


def test_keras_mask_shape_errors():
    with pytest.raises(ValueError, match=r"broadcastable.*Received: mask\.shape=\(2, 3\); expected a shape broadcastable to \(1, 3\)"):
        kmix.layers.Softmax()(np.array([[1.0, 2.0, 1.0]]), mask=np.ones((2, 3)))
    with pytest.raises(ValueError, match="must not have more dimensions"):
        kmix.layers.Softmax()(np.array([[1.0, 2.0, 1.0]]), mask=np.ones((1, 1, 3)))
    with pytest.raises(ValueError, match=r"Received: bias\.shape=\(2, 5\)"):
        kmix.layers.MaskedSoftmax()(np.zeros((2, 4, 4)), bias=np.zeros((2, 5)))


def test_computes_in_float32_under_mixed_float16():
    keras.config.set_dtype_policy("mixed_float16")
    rng = np.random.default_rng(0)
    logits16 = rng.normal(scale=3.0, size=(4, 2048)).astype(np.float16)
    keep = rng.random((4, 2048)) > 0.3
    expected = float64_softmax(logits16, keep)
    ours = kmix.layers.Softmax(output_dtype="float32")(logits16, mask=keep)
    assert ours.dtype == tf.float32
    assert np.max(np.abs(ours.numpy() - expected)) <= 1e-6
    # The drop-in keeps the compute dtype: float16, correctly rounded from float32.
    ours16 = kmix.layers.Softmax()(logits16, mask=keep)
    assert ours16.dtype == tf.float16
    np.testing.assert_array_less(np.abs(ours16.numpy() - expected), np.spacing(expected.astype(np.float16)) * 1.01)
    # Keras's float16 softmax as the yardstick: it is much further off.
    theirs = keras.layers.Softmax()(logits16, mask=keep)
    assert np.max(np.abs(theirs.numpy() - expected)) > 10 * np.max(np.abs(ours.numpy() - expected))


def test_float32_inputs_are_not_cast_down_first():
    keras.config.set_dtype_policy("mixed_float16")
    x = np.array([[1.0, 1.0 + 2e-4, 1.0 - 2e-4]], np.float32)  # not float16-representable
    got = kmix.layers.Softmax(output_dtype="float32")(x)
    np.testing.assert_allclose(got, float64_softmax(x, True), atol=1e-7)
    cast_first = kmix.layers.Softmax(output_dtype="float32", autocast=True)(x)
    assert np.max(np.abs(cast_first.numpy() - float64_softmax(x, True))) > 1e-5


def test_masked_softmax_bias_and_mask_combine():
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(2, 3, 5)).astype(np.float16)
    keep_mask = rng.random((2, 1, 5)) > 0.3
    keep_bias = rng.random((3, 5)) > 0.3
    keep_bias[1] = False
    bias = tf.cast(np.where(keep_bias, 0.0, -1e9), tf.float16)  # -inf in float16
    got = kmix.layers.MaskedSoftmax(output_dtype="float32")(scores, mask=keep_mask, bias=bias)
    np.testing.assert_allclose(got, float64_softmax(scores, keep_mask & keep_bias), atol=1e-6)
    np.testing.assert_array_equal(got.numpy()[:, 1], 0.0)


def test_output_dtype_validation():
    with pytest.raises(ValueError, match=r"Received: output_dtype='int32'"):
        kmix.layers.Softmax(output_dtype="int32")


@pytest.mark.parametrize(
    "make_layer, call_kwargs",
    [
        (lambda: kmix.layers.Softmax(), None),
        (lambda: kmix.layers.Softmax(axis=(1, 2), output_dtype="float32"), {"mask": np.ones((1, 4, 5), bool)}),
        (lambda: kmix.layers.MaskedSoftmax(), {"mask": np.ones((4, 5)), "bias": np.zeros((2, 4, 5), np.float32)}),
        (lambda: kmix.layers.MaskedSoftmax(output_dtype="bfloat16"), {"bias": np.zeros((5,), np.float16)}),
    ],
    ids=["softmax", "softmax_f32_out", "masked", "masked_bf16_out"],
)
def test_layer_dtypes(make_layer, call_kwargs):
    assert_layer_dtypes(make_layer, (2, 4, 5), call_kwargs=call_kwargs)


def test_serialization_round_trips():
    for layer in (
        kmix.layers.Softmax(),
        kmix.layers.Softmax(axis=(1, 2), output_dtype="float32", name="probs"),
        kmix.layers.MaskedSoftmax(axis=-2, autocast=True, dtype="mixed_bfloat16"),
    ):
        clone = assert_config_round_trip(layer)
        assert type(clone) is type(layer)
    keras.config.set_dtype_policy("mixed_float16")
    scores_in = keras.Input((3, 6))
    mask_in = keras.Input((6,), dtype="bool")
    bias_in = keras.Input((3, 6))
    scores = keras.layers.Dense(6)(scores_in)
    probs = kmix.layers.MaskedSoftmax(output_dtype="float32")(scores, mask=mask_in[:, None, :], bias=bias_in)
    probs = kmix.layers.Softmax(axis=(1, 2))(probs)
    model = keras.Model([scores_in, mask_in, bias_in], probs)
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(2, 3, 6)).astype(np.float32), rng.random((2, 6)) > 0.3,
         np.where(rng.random((2, 3, 6)) > 0.2, 0.0, -1e9).astype(np.float32)]
    loaded = assert_model_round_trip(model, x)
    assert type(loaded.layers[-1]) is kmix.layers.Softmax
    assert loaded.layers[-1].axis in ([1, 2], (1, 2))


# The failure itself: a hand-written `(1 - mask) * -1e9` mask under mixed_float16.

T, VOCAB, DIM = 8, 12, 16


def attention_classifier(masking, jit_compile=False, run_eagerly=False):
    """Token ids + padding mask -> one self-attention layer -> 2 classes."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((T,), dtype="int32")
    keep = keras.Input((T,), dtype="float32")
    h = keras.layers.Embedding(VOCAB, DIM)(tokens)
    q, k, v = (keras.layers.Dense(DIM, name=n)(h) for n in "qkv")
    scores = keras.ops.einsum("btd,bsd->bts", q, k) / math.sqrt(DIM)
    if masking == "hand":
        mask = keras.ops.cast(keep, scores.dtype)[:, None, :]
        probs = keras.layers.Softmax()(scores + (1.0 - mask) * -1e9)
    else:
        probs = kmix.layers.MaskedSoftmax()(scores, mask=keep[:, None, :])
    context = keras.ops.einsum("bts,bsd->btd", probs, v)
    pooled = keras.layers.GlobalAveragePooling1D()(context)
    logits = keras.layers.Dense(2, dtype="float32")(pooled)
    model = keras.Model([tokens, keep], logits)
    model.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
        run_eagerly=run_eagerly,
    )
    return model


def classification_data(n=64):
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, T + 1, size=n)
    keep = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    tokens = (rng.integers(1, VOCAB, size=(n, T)) * keep).astype(np.int32)
    labels = (tokens == 1).any(axis=1).astype(np.int32)  # does token 1 occur?
    return [tokens, keep], labels


def train(policy, masking, epochs=8, jit_compile=False, run_eagerly=False):
    keras.config.set_dtype_policy(policy)
    model = attention_classifier(masking, jit_compile, run_eagerly)
    model.optimizer.build(model.trainable_variables)  # built before fit: one trace of the train step, not two
    x, y = classification_data()
    history = model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return history.history["loss"]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # -1e9 in float16: the point
def test_hand_written_mask_gives_nan_and_masked_softmax_trains_like_float32():
    reference = train("float32", "hand")
    assert np.all(np.isfinite(reference)) and reference[-1] < reference[0]
    # NaN from the first epoch on: a forward-pass failure (0 * -inf), so two epochs run eagerly show it.
    broken = train("mixed_float16", "hand", epochs=2, run_eagerly=True)
    assert np.all(np.isnan(broken)), broken
    fixed = train("mixed_float16", "kmix", jit_compile=True)  # and the whole step under XLA
    assert np.all(np.isfinite(fixed))
    np.testing.assert_allclose(fixed, reference, rtol=5e-3)  # ~1e-4 apart in practice


def test_additive_bias_as_mask_raises_and_keep_mask_as_bias_warns():
    x = np.random.default_rng(0).normal(size=(2, 3, 5)).astype(np.float32)
    keep = np.array([True, True, False, True, False])
    bias = np.where(keep, 0.0, -1e9).astype(np.float32)
    with pytest.raises(ValueError, match=r"outside \[0, 1\].*`bias=` of `kmix.layers.MaskedSoftmax`"):
        kmix.layers.Softmax()(x, mask=bias)
    with pytest.raises(ValueError, match=r"outside \[0, 1\].*`bias=` instead"):
        kmix.layers.MaskedSoftmax()(x, mask=bias)
    with pytest.warns(UserWarning, match="only 0 and 1"):
        kmix.layers.MaskedSoftmax()(x, bias=keep.astype(np.float32))
    # Given the right way, mask and bias agree with the float64 softmax over the kept positions.
    e = np.exp(x[..., keep].astype(np.float64) - x[..., keep].max(-1, keepdims=True))
    want = np.zeros(x.shape)
    want[..., keep] = e / e.sum(-1, keepdims=True)
    for got in (kmix.layers.MaskedSoftmax()(x, bias=bias), kmix.layers.Softmax()(x, mask=keep.astype(np.float32))):
        np.testing.assert_allclose(got, want, atol=1e-6)
