"""Softmax layers that compute in float32 whatever the dtype policy.

`Softmax` is a drop-in for `keras.layers.Softmax`; `MaskedSoftmax` adds an
additive `bias` for code that masks with large negatives. Both keep the
layer's compute dtype for their output (so a mixed model's activations stay
float16) unless `output_dtype` says otherwise, and neither lets Keras cast the
inputs down to the compute dtype first (`autocast=False` by default): the
logits reach the float32 softmax at the precision they were computed in.
"""

import keras

from kmix.ops.softmax import _masked_softmax


@keras.saving.register_keras_serializable(package="kmix")
class Softmax(keras.layers.Softmax):
    """Drop-in `keras.layers.Softmax` that computes in float32 and never NaNs.

    Same call, same mask rule (True or > 0.5 keeps), same errors for masks
    that do not broadcast; a lower-rank mask that broadcasts two ways (a
    `(B, S)` mask on `(B, H, T, S)` with `B == T`) is refused, not guessed.
    Masked positions give 0, a fully masked row gives zeros, and gradients
    are zero there (see `kmix.ops.masked_softmax`).

    Args:
        axis: an int or a tuple of ints: the axes normalised over.
        output_dtype: the output dtype; the layer's compute dtype by default
            (float16 under `mixed_float16`). `"float32"` keeps float32.
        autocast: whether Keras casts float inputs to the compute dtype before
            the call. Defaults to False, so float32 logits stay float32.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: the logits.
        mask: optional bool or numeric mask broadcastable to `inputs` (of
            lower rank: a `(B, S)` key mask or a `(T, S)` shared one on
            `(B, H, T, S)`, see `kmix.ops.masked_softmax`); True
            (or a value > 0.5) keeps a position, as in Keras (torch's
            `key_padding_mask` is the opposite). A numeric mask must hold
            values in [0, 1]: an additive bias (0 / -1e9) raises a
            `ValueError` pointing to `MaskedSoftmax`'s `bias`.

    Returns:
        The probabilities, of `inputs`'s shape.

    Example:
        >>> keras.config.set_dtype_policy("mixed_float16")
        >>> layer = kmix.layers.Softmax(output_dtype="float32")
        >>> layer(np.array([[1.0, 2.0, 1.0]]), mask=np.array([[1, 1, 0]]))
        <tf.Tensor: shape=(1, 3), dtype=float32,
                    numpy=array([[0.26894143, 0.7310586 , 0.        ]], dtype=float32)>
    """

    # Where the error for an additive bias passed as `mask` sends the user.
    _mask_names = {"bias_where": " of `kmix.layers.MaskedSoftmax`"}

    def __init__(self, axis=-1, output_dtype=None, autocast=False, **kwargs):
        if not isinstance(autocast, bool):
            raise TypeError(f"`autocast` must be True or False. Received: autocast={autocast!r}.")
        super().__init__(axis=axis, autocast=autocast, **kwargs)
        self.output_dtype = _standardize_output_dtype(output_dtype)

    def call(self, inputs, mask=None):
        return self._softmax(inputs, mask=mask)

    def _softmax(self, inputs, mask=None, bias=None):
        return _masked_softmax(
            inputs,
            mask,
            bias,
            self.axis,
            self.output_dtype or self.compute_dtype,
            log=False,
            names={"logits": "inputs", **self._mask_names},
        )

    def compute_output_spec(self, inputs, mask=None):
        return keras.KerasTensor(inputs.shape, dtype=self.output_dtype or self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({"output_dtype": self.output_dtype, "autocast": self.autocast})
        return config


@keras.saving.register_keras_serializable(package="kmix")
class MaskedSoftmax(Softmax):
    """Float32 softmax taking a boolean `mask` and/or an additive `bias`.

    The layer form of `kmix.ops.masked_softmax`, for attention code that
    builds an additive mask: a bias of 0 keeps, values <= -1e3 (-1e4, -1e9,
    `finfo.min`, `-inf`, also a float16 bias whose -1e9 became `-inf`) mask.

    Args:
        axis: an int or a tuple of ints: the axes normalised over.
        output_dtype: the output dtype; the layer's compute dtype by default.
        autocast: whether Keras casts float inputs to the compute dtype before
            the call. Defaults to False.
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: the logits, e.g. attention scores `(batch, heads, T, S)`.
        mask: optional bool or numeric mask broadcastable to `inputs` (of
            lower rank, read as `kmix.ops.masked_softmax` says); True
            (or a value > 0.5) keeps, as in Keras. A numeric mask with
            values outside [0, 1] (an additive bias given as `mask`) raises
            a `ValueError`; see `kmix.ops.masked_softmax` for graph mode.
        bias: optional additive float bias broadcastable to `inputs`. One
            holding only 0 and 1 (a keep-mask given as `bias`, which masks
            nothing) gives a warning when its values are known.

    Returns:
        The probabilities, of `inputs`'s shape.

    Example:
        >>> scores = np.zeros((1, 2, 3), "float16")
        >>> bias = keras.ops.cast(np.where([[[1, 1, 0]]], 0.0, -1e9), "float16")  # -inf
        >>> kmix.layers.MaskedSoftmax()(scores, bias=bias)[0, 0]
        <tf.Tensor: shape=(3,), dtype=float32, numpy=array([0.5, 0.5, 0. ], dtype=float32)>
    """

    _mask_names = {}

    def call(self, inputs, mask=None, bias=None):
        return self._softmax(inputs, mask=mask, bias=bias)

    def compute_output_spec(self, inputs, mask=None, bias=None):
        return super().compute_output_spec(inputs, mask=mask)


def _standardize_output_dtype(dtype):
    if dtype is None:
        return None
    try:
        name = keras.backend.standardize_dtype(dtype)
    except (TypeError, ValueError):
        name = None
    if name not in ("float16", "bfloat16", "float32", "float64"):
        raise ValueError(
            f"Received: output_dtype={dtype!r}; expected None (the layer's "
            "compute dtype) or one of 'float16', 'bfloat16', 'float32', 'float64'."
        )
    return name
