"""Activations that hand float32 out: a layer computes its matmul in half and its activation in float32.

`kmix.autocast` gives the layers producing a model's outputs (a `Dense` LM
head, a classifier, a convolution) the half compute dtype and one of these
activations, as TensorFlow's mixed-precision guide ends a model with a half
`Dense` and an `Activation("linear", dtype="float32")`, and torch autocast
computes `Linear` in half and the loss in float32: the matmul, most of an
LM head's cost, runs at half speed, and the activation (softmax,
log-softmax) and what follows it see float32.

Each is registered with Keras (`"kmix>float32_softmax"`, ...), so the
layer's config names it and `keras.models.load_model` rebuilds the layer as
it trained.

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

_WRAPPED = {
    keras.activations.linear: float32_linear,
    keras.activations.softmax: float32_softmax,
    keras.activations.log_softmax: float32_log_softmax,
    keras.activations.sigmoid: float32_sigmoid,
    keras.activations.tanh: float32_tanh,
    keras.activations.relu: float32_relu,
    keras.activations.gelu: float32_gelu,
    keras.activations.silu: float32_silu,
    keras.activations.softplus: float32_softplus,
}
_UNWRAPPED = {wrapped: plain for plain, wrapped in _WRAPPED.items()}


def wrap(activation):
    """The float32-out form of a Keras activation (a name or function), or None where kmix has none.

    Args:
        activation: `"linear"`, `"softmax"`, `keras.activations.relu`, ...
            (None is `"linear"`); a float32-out activation is its own form.

    Returns:
        The registered function that casts its input to float32 and applies
        `activation`, or None for an activation outside the list (a custom
        function, or one with arguments).

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
