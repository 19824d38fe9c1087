"""Softmax layers that compute in float32 whatever the dtype policy: `Softmax` and `MaskedSoftmax` (with a bias).

Their output keeps the compute dtype unless `output_dtype` says otherwise, and their inputs are not cast down
first (`autocast=False`).
"""

import keras

from kmix import _checks
from kmix.ops.softmax import _masked_softmax


@keras.saving.register_keras_serializable(package="kmix")
class Softmax(keras.layers.Softmax):
    """Drop-in `keras.layers.Softmax` that computes in float32 and never NaNs.

    Same call and mask rule (True or > 0.5 keeps) as Keras's; masked positions give 0, a fully masked row
    zeros, and the gradients there are zero (see `kmix.ops.masked_softmax`).

    Args:
        axis: an int or a tuple of ints: the axes normalised over.
        output_dtype: the output dtype; the layer's compute dtype by default.
        autocast: whether Keras casts float inputs to the compute dtype first (default False).
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: the logits.
        mask: optional bool or numeric mask broadcastable to `inputs` (of lower rank: read as
            `kmix.ops.masked_softmax` says); a numeric one must hold values in [0, 1].

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
        super().__init__(axis=axis, autocast=_checks.boolean("autocast", autocast), **kwargs)
        self.output_dtype = _standardize_output_dtype(output_dtype)

    def call(self, inputs, mask=None):
        return self._softmax(inputs, mask=mask)

    def _softmax(self, inputs, mask=None, bias=None):
        return _masked_softmax(inputs, mask, bias, self.axis, self.output_dtype or self.compute_dtype, log=False,
                               names={"logits": "inputs", **self._mask_names})

    def compute_output_spec(self, inputs, mask=None):
        return keras.KerasTensor(inputs.shape, dtype=self.output_dtype or self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "output_dtype": self.output_dtype, "autocast": self.autocast}


@keras.saving.register_keras_serializable(package="kmix")
class MaskedSoftmax(Softmax):
    """Float32 softmax taking a boolean `mask` and/or an additive `bias`.

    The layer form of `kmix.ops.masked_softmax`: a bias of 0 keeps, values <= -1e3 (-1e9, `-inf`) mask.

    Args:
        axis: an int or a tuple of ints: the axes normalised over.
        output_dtype: the output dtype; the layer's compute dtype by default.
        autocast: whether Keras casts float inputs to the compute dtype first (default False).
        **kwargs: base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: the logits, e.g. attention scores `(batch, heads, T, S)`.
        mask: optional bool or numeric mask broadcastable to `inputs`, as `Softmax`'s.
        bias: optional additive float bias broadcastable to `inputs`.

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
        raise ValueError(f"Received: output_dtype={dtype!r}; expected None (the layer's compute dtype) or one of "
                         "'float16', 'bfloat16', 'float32', 'float64'.")
    return name
