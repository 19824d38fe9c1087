"""`kmix.layers.Remat`: recompute a layer's forward pass in the backward pass (gradient checkpointing).

Unlike `keras.RematScope` (`tf.recompute_grad`, which refuses keyword arguments in a graph,
keras-team/keras#21207, and lets seed generators drift): only floating tensors go through the recomputed
function, the wrapper takes the wrapped layer's call signature, and non-trainable state (seeds, batch-norm
statistics) is replayed, so dropout draws the same masks twice and no state is updated twice.
"""

import functools
import inspect

import keras
import tensorflow as tf

from kmix import _checks as checks


@keras.saving.register_keras_serializable(package="kmix")
class Remat(keras.layers.Layer):
    """Runs `layer` without keeping its activations; recomputes them for the gradient.

    Loss and gradients are `layer`'s own; memory falls by its activations, for one more forward pass a
    step. Inputs and every argument reach `layer` as they are (`autocast=False`). A layer not built yet
    runs once without recomputation (its first call builds it).

    Args:
        layer: the `keras.layers.Layer` to wrap (a layer, a block or a model).
        **kwargs: `keras.layers.Layer` arguments; `dtype`, if given, must be the wrapped layer's policy.

    Example:

    >>> block = keras_hub.layers.TransformerEncoder(256, 4, dropout=0.1)
    >>> x = kmix.layers.Remat(block)(x, padding_mask=mask)
    """

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls, *args, **kwargs)
        # Keras binds call arguments against `inspect.signature(self.call)`, read in
        # `Layer.__init__`: give this instance's `call` the wrapped layer's signature
        # (Keras's own `__new__` installs per-instance methods the same way).
        layer = args[0] if args else kwargs.get("layer")
        signature = _call_signature(layer)
        if signature is not None:
            remat_call = obj.call

            @functools.wraps(remat_call)
            def call(*call_args, **call_kwargs):
                return remat_call(*call_args, **call_kwargs)

            call.__signature__ = signature
            obj.call = call
        return obj

    def __init__(self, layer, **kwargs):
        dtype = kwargs.pop("dtype", None)
        layer = checks.wrapped_layer(layer)
        if dtype is not None and keras.dtype_policies.get(dtype).name != layer.dtype_policy.name:
            raise ValueError("Remat computes under the wrapped layer's dtype policy; `dtype` may only repeat it "
                             "(`Remat.from_config` applies a config's `dtype` to the wrapped layer). Received: "
                             f"dtype={dtype!r}, layer.dtype_policy={layer.dtype_policy.name!r}.")
        kwargs.pop("autocast", None)
        super().__init__(dtype=layer.dtype_policy, autocast=False, **kwargs)
        self.layer = layer
        self.supports_masking = layer.supports_masking

    def build(self, input_shape=None):
        """Nothing to create: the wrapped layer builds itself on its first call."""

    def call(self, *args, **kwargs):
        """Calls the wrapped layer with the same arguments (bound by its signature); recomputes its activations."""
        if not self.layer.built:
            return self.layer(*args, **kwargs)  # building creates variables: not in a custom gradient
        return rematerialize(self.layer, args, kwargs)

    def compute_mask(self, inputs, mask=None):
        """The wrapped layer's mask."""
        return self.layer.compute_mask(inputs, mask)

    def get_config(self):
        """The wrapped layer, serialized."""
        config = super().get_config()
        config.pop("dtype", None)
        config.pop("autocast", None)
        config["layer"] = keras.saving.serialize_keras_object(self.layer)
        return config

    @classmethod
    def from_config(cls, config):
        """Re-creates the wrapper; the nested layer first, under the config's `dtype` if it has one."""
        config = dict(config)
        layer_config = config.pop("layer")
        dtype = config.pop("dtype", None)
        if dtype is not None:
            layer_config = {**layer_config, "config": {**layer_config["config"], "dtype": dtype}}
        layer = keras.saving.deserialize_keras_object(layer_config)
        return cls(layer, **config)


def _call_signature(layer):
    """The signature of `layer.call` (bound: no `self`), or None where it cannot be read."""
    if not isinstance(layer, keras.layers.Layer):
        return None  # `__init__` reports the bad argument
    try:
        return inspect.signature(layer.call)
    except (TypeError, ValueError):
        return None


def rematerialize(layer, args, kwargs):
    """`layer(*args, **kwargs)` (a built layer) with its activations recomputed for the gradient of its floating
    tensor arguments; everything else is bound as it is."""
    flat = tf.nest.flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if tf.is_tensor(x) and x.dtype.is_floating]
    if not positions:  # nothing to checkpoint from: the block starts at integer ids
        return layer(*args, **kwargs)
    state = [v for v in layer.variables if not v.trainable]
    before = [tf.identity(tf.convert_to_tensor(v.value)) for v in state]
    calls, structure = [], []

    def forward(*floats):
        values = list(flat)
        for i, x in zip(positions, floats):
            values[i] = x
        call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), values)
        recompute = bool(calls)
        calls.append(recompute)
        if recompute:
            # The backward pass: start from the state the forward pass saw (same seeds),
            # then put back the state the forward pass left.
            current = [tf.identity(tf.convert_to_tensor(v.value)) for v in state]
            for v, value in zip(state, before):
                v.assign(tf.cast(value, v.dtype))
        outputs = layer(*call_args, **call_kwargs)
        if recompute:
            for v, value in zip(state, current):
                v.assign(tf.cast(value, v.dtype))
        else:
            structure.append(outputs)
        tensors = [t for t in tf.nest.flatten(outputs) if tf.is_tensor(t)]
        return tensors[0] if len(tensors) == 1 else tensors

    result = tf.recompute_grad(forward)(*[flat[i] for i in positions])
    tensors = iter([result] if tf.is_tensor(result) else list(result))
    leaves = [next(tensors) if tf.is_tensor(t) else t for t in tf.nest.flatten(structure[0])]
    return tf.nest.pack_sequence_as(structure[0], leaves)
