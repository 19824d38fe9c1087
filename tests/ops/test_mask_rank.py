"""Masks and biases of lower rank than the logits: one documented reading, or a refusal naming the shapes.

The rule (`kmix.ops.arguments.align_to_logits`): a `(B, S)` mask on
`(B, H, T, S)` scores is a key mask `(B, 1, 1, S)`, a `(T, S)` one is shared
over the batch `(1, 1, T, S)`, one that could be either (`B == T`) is
refused; with the batch unknown at trace time a batch-sized mask is a key
mask. Every result is compared with a float64 NumPy softmax given the
full-rank mask the rule names.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from tests.ops.test_softmax import reference

RNG = np.random.default_rng(7)
SCORES = RNG.normal(size=(3, 2, 4, 5)).astype(np.float32)  # (B, H, T, S), B != T
KEY = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], bool)  # (B, S); the last row masks all
CAUSAL = np.tril(np.ones((4, 5), bool))  # (T, S)


def _softmax(kind, logits, **kwargs):
    if kind == "op":
        return kmix.ops.masked_softmax(logits, **kwargs)
    if kind == "MaskedSoftmax":
        return kmix.layers.MaskedSoftmax()(logits, **kwargs)
    return kmix.layers.Softmax()(logits, **kwargs)


def _bias(keep):
    return np.where(keep, 0.0, -1e9).astype(np.float32)


@pytest.mark.parametrize("kind", ["op", "MaskedSoftmax", "Softmax"])
def test_key_mask_is_read_batch_first(kind):
    got = _softmax(kind, SCORES, mask=KEY)
    expected, _ = reference(SCORES, mask=KEY[:, None, None, :])
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-6)
    assert not np.asarray(got)[2].any()  # the example with every key masked: zeros


@pytest.mark.parametrize("kind", ["op", "MaskedSoftmax", "Softmax"])
def test_causal_mask_is_shared_over_the_batch(kind):
    got = _softmax(kind, SCORES, mask=CAUSAL)
    expected, _ = reference(SCORES, mask=CAUSAL[None, None])
    np.testing.assert_allclose(np.asarray(got), expected, atol=1e-6)


def test_key_bias_is_read_batch_first_and_a_per_head_bias_aligned_to_the_last_axes():
    got = kmix.layers.MaskedSoftmax()(SCORES, bias=_bias(KEY))
    np.testing.assert_allclose(np.asarray(got), reference(SCORES, bias=_bias(KEY)[:, None, None])[0], atol=1e-6)
    heads = RNG.normal(size=(2, 4, 5)).astype(np.float32)  # (H, T, S), e.g. ALiBi; H != B
    got = kmix.ops.masked_softmax(SCORES, bias=heads)
    np.testing.assert_allclose(np.asarray(got), reference(SCORES, bias=heads[None])[0], atol=1e-6)


@pytest.mark.parametrize("kind", ["op", "MaskedSoftmax", "Softmax"])
def test_a_mask_that_reads_two_ways_is_refused_naming_the_shapes(kind):
    scores = RNG.normal(size=(4, 2, 4, 5)).astype(np.float32)  # B == T == 4
    with pytest.raises(ValueError) as info:
        _softmax(kind, scores, mask=np.ones((4, 5), bool))
    message = str(info.value)
    for words in ("broadcasts two ways", "mask.shape=(4, 5)", ".shape=(4, 2, 4, 5)",
                  "(4, 1, 1, 5)", "mask[:, None, None, :]", "(1, 1, 4, 5)", "mask[None, None]"):
        assert words in message, f"{words!r} not in: {message}"


def test_a_bias_that_reads_two_ways_is_refused_and_full_rank_is_taken():
    scores = RNG.normal(size=(4, 2, 4, 5)).astype(np.float32)
    key = RNG.random((4, 5)) > 0.3
    with pytest.raises(ValueError, match=r"bias.*broadcasts two ways.*bias\[:, None, None, :\]"):
        kmix.ops.masked_softmax(scores, bias=_bias(key))
    got = kmix.ops.masked_softmax(scores, bias=_bias(key)[:, None, None, :])  # as the message says
    np.testing.assert_allclose(np.asarray(got), reference(scores, mask=key[:, None, None])[0], atol=1e-6)


def test_a_mask_that_fits_neither_reading_is_refused():
    with pytest.raises(ValueError, match=r"neither batch-first nor aligned to the last axes.*mask\.shape=\(2, 5\)"):
        kmix.ops.masked_softmax(SCORES, mask=np.ones((2, 5), bool))  # 2 is neither B=3 nor T=4
    with pytest.raises(ValueError, match=r"mask\.shape=\(3, 6\); expected a shape broadcastable to \(3, 2, 4, 5\)"):
        kmix.ops.masked_softmax(SCORES, mask=np.ones((3, 6), bool))  # the key axis itself is wrong


def test_unknown_batch_reads_a_batch_sized_mask_as_a_key_mask_and_a_static_one_as_shared():
    """In a graph with the batch unknown: (None, S) is a key mask, a static (T, S) is shared."""
    key_fn = tf.function(lambda x, m: kmix.ops.masked_softmax(x, mask=m), input_signature=[
        tf.TensorSpec((None, 2, 4, 5)), tf.TensorSpec((None, 5), tf.bool)])
    np.testing.assert_allclose(key_fn(SCORES, KEY).numpy(), reference(SCORES, mask=KEY[:, None, None])[0], atol=1e-6)
    scores = RNG.normal(size=(4, 2, 4, 5)).astype(np.float32)  # B == T at run time: still the static reading
    shared_fn = tf.function(lambda x, m: kmix.ops.masked_softmax(x, mask=m), input_signature=[
        tf.TensorSpec((None, 2, 4, 5)), tf.TensorSpec((4, 5), tf.bool)])
    np.testing.assert_allclose(shared_fn(scores, CAUSAL).numpy(), reference(scores, mask=CAUSAL[None, None])[0],
                               atol=1e-6)


def test_functional_model_with_a_padding_mask_input_reads_it_as_a_key_mask():
    scores_in, mask_in = keras.Input((2, 4, 5)), keras.Input((5,), dtype="bool")
    model = keras.Model([scores_in, mask_in], kmix.layers.MaskedSoftmax()(scores_in, mask=mask_in))
    key = RNG.random((3, 5)) > 0.4
    got = model.predict([SCORES, key], verbose=0, batch_size=3)
    np.testing.assert_allclose(got, reference(SCORES, mask=key[:, None, None])[0], atol=1e-6)
    # Keras traces its first call with that batch's shape: a batch the size of T is refused there.
    # (Retraced with the batch unknown, the mask is the key mask above, never the other reading.)
    fresh = keras.Model([scores_in, mask_in], kmix.layers.MaskedSoftmax()(scores_in, mask=mask_in))
    with pytest.raises(ValueError, match=r"broadcasts two ways.*mask\[:, None, None, :\]"):
        fresh.predict([RNG.normal(size=(4, 2, 4, 5)).astype(np.float32), np.ones((4, 5), bool)], verbose=0,
                      batch_size=4)


def test_scalar_and_rank_one_masks_broadcast_as_numpy():
    got = kmix.ops.masked_softmax(SCORES, mask=True)
    np.testing.assert_allclose(np.asarray(got), reference(SCORES)[0], atol=1e-6)
    last = np.array([1, 1, 0, 1, 0], bool)
    got = kmix.ops.masked_softmax(SCORES, mask=last)
    np.testing.assert_allclose(np.asarray(got), reference(SCORES, mask=last)[0], atol=1e-6)
