"""`keras.layers.MultiHeadAttention` whose attention softmax is always float32 and masked.

Both of Keras's attention paths (the fused `dot_product_attention` and einsum + `Softmax`) are replaced by
the explicit one around `kmix.ops.masked_softmax`, through the `_compute_attention` / `_masked_softmax` hooks
Keras documents for overriding.
"""

import keras
from keras import ops

from kmix.ops.arguments import align_to_logits, check_broadcastable, keep_from_mask
from kmix.ops.softmax import _masked_softmax

_NAMES = {"mask": "attention_mask", "bias": "attention_bias"}


@keras.saving.register_keras_serializable(package="kmix")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """Drop-in `keras.layers.MultiHeadAttention` with a float32 masked softmax.

    Same constructor, weights and call as Keras's layer, plus an optional additive `attention_bias`. The
    probabilities are float32 on every path; masked positions get exactly 0 and a query whose every key is
    masked attends to nothing (zeros). `flash_attention` only keeps Keras's argument checks.

    Args:
        num_heads: number of attention heads.
        key_dim: size of each head for query and key.
        **kwargs: every other argument of `keras.layers.MultiHeadAttention`.

    Call arguments:
        query, value, key, query_mask, value_mask, key_mask, attention_mask, return_attention_scores,
        training, use_causal_mask: as Keras. `attention_mask` keeps where True; a numeric one must hold
            values in [0, 1] (an additive 0 / -1e9 mask there raises a `ValueError` naming `attention_bias`).
        attention_bias: optional additive float bias, `(B, T, S)` or `(B, N, T, S)`, broadcastable: 0 keeps,
            values <= -1e3 mask. A rank-2 mask or bias is a `(B, S)` key mask or a `(T, S)` one shared over
            the batch; one that could be either is refused.

    Returns:
        The attention output `(B, T, dim)`, and with
        `return_attention_scores=True` also the probabilities `(B, N, T, S)`.

    Example:
        >>> keras.config.set_dtype_policy("mixed_float16")
        >>> mha = kmix.layers.MultiHeadAttention(num_heads=2, key_dim=8)
        >>> x = np.random.normal(size=(2, 5, 16))
        >>> bias = np.where(np.arange(5) < 3, 0.0, -1e9)[None, None, :]  # (1, 1, S)
        >>> mha(x, x, attention_bias=bias).shape
        TensorShape([2, 5, 16])
    """

    def call(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None, attention_mask=None,
             return_attention_scores=False, training=None, use_causal_mask=False, attention_bias=None):
        if attention_bias is not None:
            attention_bias = ops.convert_to_tensor(attention_bias)
            bias_dtype = keras.backend.standardize_dtype(attention_bias.dtype)
            if not keras.backend.is_float_dtype(bias_dtype):
                raise TypeError(f"Received: attention_bias.dtype={bias_dtype}; expected a float dtype (0 keeps, large "
                                "negatives mask). Pass a boolean mask as `attention_mask`.")
        in_range = None
        if attention_mask is not None and len(query.shape) == 3 and len(attention_mask.shape) < 3:
            # Keras combines `attention_mask` with the causal and padding masks as NumPy
            # broadcasts, before `_masked_softmax`: read a rank-2 mask by kmix's rule first.
            scores = (query.shape[0], query.shape[1], (value if key is None else key).shape[1])
            attention_mask = align_to_logits(ops.convert_to_tensor(attention_mask), scores, "attention_mask",
                                             "attention_scores[:, 0]")
        if attention_mask is not None:
            # Keras casts `attention_mask` to bool (non-zero keeps), which would turn an
            # additive 0 / -1e9 bias given here into its inverse: check it first.
            attention_mask, in_range = keep_from_mask(attention_mask, _NAMES)
        # Keras's `call` hands `_compute_attention` a fixed argument list, so
        # the bias travels beside it for the length of this call. Set with
        # object.__setattr__: a tensor is not layer state to be tracked.
        object.__setattr__(self, "_kmix_attention_bias", attention_bias)
        # In a graph, the mask's in-range flag: NaN probabilities where XLA drops the assertion.
        object.__setattr__(self, "_kmix_mask_in_range", in_range)
        try:
            return super().call(query, value, key=key, query_mask=query_mask, value_mask=value_mask, key_mask=key_mask,
                                attention_mask=attention_mask, return_attention_scores=return_attention_scores,
                                training=training, use_causal_mask=use_causal_mask)
        finally:
            object.__setattr__(self, "_kmix_attention_bias", None)
            object.__setattr__(self, "_kmix_mask_in_range", None)

    def _compute_attention(self, query, key, value, attention_mask=None, training=None, return_attention_scores=False,
                           use_causal_mask=False):
        if self._flash_attention and return_attention_scores:
            raise ValueError("Returning attention scores is not supported when flash attention is enabled. Please "
                             "disable flash attention to access attention scores.")
        # Keras's `call` folds a causal mask into `attention_mask` for a
        # subclass that overrides this method; honour the flag if it comes.
        if use_causal_mask:
            causal_mask = self._compute_causal_mask(query, value)
            attention_mask = (causal_mask if attention_mask is None
                              else ops.logical_and(ops.cast(attention_mask, "bool"), causal_mask))
        query = ops.multiply(query, ops.cast(self._inverse_sqrt_key_dim, query.dtype))
        attention_scores = ops.einsum(self._dot_product_equation, key, query)
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        final_attn_scores = (self._dropout_layer(attention_scores, training=training) if self._dropout > 0.0
                             else attention_scores)
        return ops.einsum(self._combine_equation, final_attn_scores, value), attention_scores

    def _masked_softmax(self, attention_scores, attention_mask=None):
        rank = len(attention_scores.shape)
        num_axes = len(self._attention_axes)
        # Masks and biases come as (B, T, S); the heads axis goes in before
        # the query axes, as Keras does for `attention_mask`.
        expansion_axis = -num_axes * 2 - 1
        bias = getattr(self, "_kmix_attention_bias", None)
        if attention_mask is not None:
            attention_mask = _to_scores_rank(attention_mask, attention_scores.shape, expansion_axis, _NAMES["mask"])
        if bias is not None:
            shown_shape = bias.shape
            bias = _to_scores_rank(bias, attention_scores.shape, expansion_axis, _NAMES["bias"])
            check_broadcastable(bias.shape, attention_scores.shape, "attention_bias", "attention_scores",
                                shown_shape=shown_shape)
        # Scores in bfloat16 or float32 cannot overflow to -inf; float16 ones can.
        probs = _masked_softmax(attention_scores, attention_mask, bias, tuple(range(rank - num_axes, rank)),
                                attention_scores.dtype, log=False, names={"logits": "attention_scores", **_NAMES},
                                infinite_logits=attention_scores.dtype == "float16")
        in_range = getattr(self, "_kmix_mask_in_range", None)
        if in_range is not None:
            probs = ops.where(in_range, probs, ops.full((), float("nan"), probs.dtype))
        return probs

    def compute_output_spec(self, query, value, key=None, query_mask=None, value_mask=None, key_mask=None,
                            attention_mask=None, return_attention_scores=False, training=None, use_causal_mask=False,
                            attention_bias=None):
        return super().compute_output_spec(query, value, key=key, query_mask=query_mask, value_mask=value_mask,
                                           key_mask=key_mask, attention_mask=attention_mask,
                                           return_attention_scores=return_attention_scores, training=training,
                                           use_causal_mask=use_causal_mask)


def _to_scores_rank(tensor, scores_shape, axis, name):
    """A mask or bias with the scores' rank: aligned to `(B, T, S)` (`align_to_logits`), then heads at `axis`."""
    rank = len(scores_shape)
    if len(tensor.shape) < rank - 1:
        heads = rank + axis
        without_heads = list(scores_shape)
        del without_heads[heads]
        # Named as what it is: the scores of one head, `attention_scores[:, 0]` by default.
        tensor = align_to_logits(tensor, without_heads, name, f"attention_scores[{':, ' * heads}0]")
    return _expand_to_rank(tensor, rank, axis)


def _expand_to_rank(tensor, rank, axis):
    """Inserts size-1 axes at `axis` (Keras's heads axis; in front where too short) until `tensor` has `rank`."""
    for _ in range(rank - len(tensor.shape)):
        tensor = ops.expand_dims(tensor, axis=axis if len(tensor.shape) + 1 >= -axis else 0)
    return tensor
