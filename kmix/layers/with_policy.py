"""`kmix.layers.WithPolicy`: run one layer, block or sub-model under another policy."""

import inspect

import keras

from kmix import _checks as checks
from kmix.policy.policy import Policy, parse


@keras.saving.register_keras_serializable(package="kmix")
class WithPolicy(keras.layers.Layer):
    """Runs `layer` under `policy` inside a model that uses another policy.

    Floating inputs are cast to `policy.compute_dtype`, the wrapped layer and every layer inside it get
    the policy `policy.to_keras()` (in place; a built one must already hold `policy.params_dtype`
    variables), and floating outputs are cast to `policy.output_dtype`. Integer and boolean inputs pass.

    Args:
        layer: a `keras.layers.Layer` (a single layer, a block, or a model).
        policy: anything `kmix.Policy` accepts (`"float32"`, `"O1"`, ...).
        **kwargs: `keras.layers.Layer` arguments (`name`, `trainable`); not `dtype`.

    Example:

    >>> kmix.set_policy("mixed_float16")
    >>> x = keras.Input((16,))
    >>> h = keras.layers.Dense(32)(x)                                      # float16
    >>> h = kmix.layers.WithPolicy(keras.layers.LayerNormalization(), "float32")(h)
    >>> h.dtype                                                            # float32
    'float32'
    """

    def __init__(self, layer, policy, **kwargs):
        if "dtype" in kwargs:
            raise ValueError("WithPolicy takes its dtype from `policy`; do not pass `dtype`. "
                             f"Received: dtype={kwargs['dtype']!r}, policy={policy!r}.")
        layer = checks.wrapped_layer(layer)
        if isinstance(policy, dict):
            policy = Policy.from_config(policy)
        policy = parse(policy, "policy")
        super().__init__(dtype=policy.to_keras(), **kwargs)
        _apply_policy(layer, policy)
        self.layer = layer
        self._policy = policy
        self.supports_masking = layer.supports_masking
        self._call_parameters = _call_parameters(layer)

    @property
    def policy(self):
        """The `kmix.Policy` the wrapped layer runs under."""
        return self._policy

    def build(self, input_shape=None):
        """Nothing to create: the wrapped layer (which may take several inputs) builds itself on its first call."""

    def call(self, inputs, *args, training=None, mask=None, **kwargs):
        """Calls the wrapped layer on `inputs` cast to the compute dtype; casts its outputs."""
        policy = self._policy
        inputs, args, kwargs = policy.cast_to_compute((inputs, args, kwargs))
        if self._call_parameters is None or "training" in self._call_parameters:
            kwargs["training"] = training
        if mask is not None and (self._call_parameters is None or "mask" in self._call_parameters):
            kwargs["mask"] = mask
        return policy.cast_to_output(self.layer(inputs, *args, **kwargs))

    def compute_mask(self, inputs, mask=None):
        """The wrapped layer's mask."""
        return self.layer.compute_mask(inputs, mask)

    def get_config(self):
        """The wrapped layer, serialized, and the policy's config."""
        config = super().get_config()
        config.pop("dtype", None)
        return {**config, "layer": keras.saving.serialize_keras_object(self.layer), "policy": self._policy.get_config()}

    @classmethod
    def from_config(cls, config):
        """Re-creates the wrapper; the nested layer is deserialized (and built) first."""
        config = dict(config)
        layer = keras.saving.deserialize_keras_object(config.pop("layer"))
        policy = config.pop("policy")
        return cls(layer, Policy.from_config(policy) if isinstance(policy, dict) else policy, **config)


def _call_parameters(layer):
    """The names `layer.call` accepts, or `None` when it takes `**kwargs`."""
    try:
        params = inspect.signature(layer.call).parameters.values()
    except (TypeError, ValueError):
        return None
    return None if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) else {p.name for p in params}


def _sublayers(layer):
    """`layer` and every layer reachable through its attributes, each once."""
    found, stack, seen = [], [layer], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, keras.layers.Layer):
            found.append(obj)
            stack.extend(vars(obj).values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
    return found


def _apply_policy(layer, policy):
    """Gives every layer in `layer` the Keras policy; checks built ones first."""
    keras_policy = policy.to_keras()
    layers = [sub for sub in _sublayers(layer) if not isinstance(sub, keras.layers.InputLayer)]
    for sub in layers:
        if sub.built and sub.weights and sub.dtype_policy.variable_dtype != policy.params_dtype:
            floating = [v for v in sub.weights if keras.backend.is_float_dtype(v.dtype)]
            if any(keras.backend.standardize_dtype(v.dtype) != policy.params_dtype for v in floating):
                where = "" if sub is layer else f" (in {layer.name!r})"
                raise ValueError(f"Layer {sub.name!r}{where} is already built with {sub.dtype_policy.variable_dtype} "
                                 f"variables, but policy {policy.spec!r} keeps parameters in {policy.params_dtype}. "
                                 f"Received: layer={layer.name!r}, policy={policy!r}. Wrap the layer before it is "
                                 f"built (before its first call), or pass a policy with "
                                 f"params={sub.dtype_policy.variable_dtype}.")
    for sub in layers:
        if sub.dtype_policy != keras_policy:
            sub.dtype_policy = keras_policy
