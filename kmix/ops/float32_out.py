"""Activations that hand float32 out: a layer computes its matmul in half and its activation in float32.

`kmix.autocast` gives a model's output layers (an LM head, a classifier) one of these; each is registered
with Keras (`"kmix>float32_softmax"`, ...), so `keras.models.load_model` rebuilds the layer as it trained.

    x = keras.layers.Dense(10, activation=kmix.ops.float32_out.wrap("softmax"))(x)
"""

import keras

_register = keras.saving.register_keras_serializable(package="kmix")


def _float32(x):
    return keras.ops.cast(x, "float32")


def _float32_form(name, activation):
    """`activation` applied in float32, registered with Keras as `kmix>float32_<name>`."""

    def function(x):
        return activation(_float32(x))

    function.__name__ = function.__qualname__ = f"float32_{name}"
    function.__doc__ = f"`keras.activations.{name}` of `x` cast to float32."
    return _register(function)


float32_linear = _float32_form("linear", lambda x: x)
float32_softmax = _float32_form("softmax", keras.activations.softmax)
float32_log_softmax = _float32_form("log_softmax", keras.activations.log_softmax)
float32_sigmoid = _float32_form("sigmoid", keras.activations.sigmoid)
float32_tanh = _float32_form("tanh", keras.activations.tanh)
float32_relu = _float32_form("relu", keras.activations.relu)
float32_gelu = _float32_form("gelu", keras.activations.gelu)
float32_silu = _float32_form("silu", keras.activations.silu)
float32_softplus = _float32_form("softplus", keras.activations.softplus)

_WRAPPED = {keras.activations.get(f.__name__[len("float32_"):]): f for f in (
    float32_linear, float32_softmax, float32_log_softmax, float32_sigmoid, float32_tanh, float32_relu, float32_gelu,
    float32_silu, float32_softplus)}
_UNWRAPPED = {wrapped: plain for plain, wrapped in _WRAPPED.items()}


def wrap(activation):
    """The float32-out form of a Keras activation (a name or function), or None where kmix has none.

    Args:
        activation: `"linear"`, `"softmax"`, `keras.activations.relu`, ... (None is `"linear"`); a
            float32-out activation is its own form.

    Returns:
        The registered function that casts its input to float32 and applies `activation`, or None.

    Example:

    >>> kmix.ops.float32_out.wrap("softmax") is kmix.ops.float32_out.float32_softmax
    True
    """
    if activation in _UNWRAPPED:
        return activation
    try:
        function = keras.activations.get(activation)
    except ValueError:
        return None
    return _WRAPPED.get(function)


def unwrap(activation):
    """The plain Keras activation a float32-out one wraps; any other activation as it is."""
    return _UNWRAPPED.get(activation, activation)


def is_wrapped(activation):
    """Whether `activation` is one of this module's float32-out activations."""
    return activation in _UNWRAPPED
