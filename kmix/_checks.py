"""Argument checks shared by kmix's constructors: one wording for every error.

Each check returns the value in its canonical type or raises naming the
argument, what was received and what is accepted, the way Keras does:
"`growth_factor` must be > 1. Received: growth_factor=1.0".
"""

import math
import numbers

import keras


def integer(name, value, minimum=1):
    """`value` as an int >= `minimum`; `TypeError` / `ValueError` naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be an int >= {minimum}. Received: {name}={value!r} "
            f"(of type {type(value).__name__})."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}. Received: {name}={value!r}")
    return int(value)


def boolean(name, value):
    """`value` if it is True or False; a `TypeError` naming `name` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False. Received: {name}={value!r}.")
    return value


def optimizer(value):
    """A Keras optimizer from `value` (one, its name or its config dict); errors naming `optimizer` otherwise."""
    if isinstance(value, keras.optimizers.Optimizer):
        return value
    if isinstance(value, (str, dict)):
        try:
            return keras.optimizers.get(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"`optimizer` names no Keras optimizer ({type(e).__name__}: {str(e)[:200]}). "
                             f"Received: optimizer={value!r}") from None
    raise TypeError("`optimizer` must be a Keras optimizer (a keras.optimizers.Optimizer), its name (e.g. \"adamw\") "
                    f"or its config dict. Received: optimizer={value!r} of type {type(value).__name__}.")


def real(name, value, low=None, high=None, low_open=False, high_open=False, allow_inf=False):
    """`value` as a float within the bounds; `TypeError` / `ValueError` naming `name` otherwise.

    Args:
        name: the argument's name, for the message.
        value: what was received.
        low, high: the bounds, or None for none.
        low_open, high_open: whether a bound itself is excluded.
        allow_inf: whether +-inf passes (NaN never does).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a real number. Received: {name}={value!r} "
            f"(of type {type(value).__name__})."
        )
    big = isinstance(value, numbers.Integral) and abs(value) >= 2**1024  # beyond float's range
    number = math.inf * (1 if value > 0 else -1) if big else float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise ValueError(f"`{name}` must be finite. Received: {name}={value!r}")
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and (number >= high if high_open else number > high)
    if below or above:
        raise ValueError(f"`{name}` must be {_bounds(low, high, low_open, high_open)}. Received: {name}={value!r}")
    return number


def _bounds(low, high, low_open, high_open):
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in the interval {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def wrapped_layer(layer):
    """`layer` (deserialized if it is a config dict) for a wrapper layer; `TypeError` otherwise."""
    import keras

    if isinstance(layer, dict):
        layer = keras.saving.deserialize_keras_object(layer)
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(
            "`layer` must be a keras.layers.Layer (a layer, a block or a model). "
            f"Received: layer={layer!r} (of type {type(layer).__name__})."
        )
    return layer


def built_model(model, layers_may_stand_in=False):
    """`model` if it is a built `keras.Model`; `TypeError` / `ValueError` saying what to do otherwise.

    Args:
        model: what was received.
        layers_may_stand_in: accept an unbuilt model whose layers are all built (keras.io's VAE
            trains its built encoder and decoder in `train_step` and never calls the model).
    """
    import keras

    from kmix._tree import walk

    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a keras.Model. Received: model={model!r} (of type {type(model).__name__})."
        )
    if model.built:
        return model
    layers = [layer for _, layer, _ in walk(model)] if layers_may_stand_in else []
    if not (layers and all(layer.built for layer in layers)):
        raise ValueError(
            f"`model` must be built, so that its layers have variables. Received: model "
            f"{model.name!r} ({type(model).__name__}), not built. Start it with `keras.Input(shape)`, "
            "call it on a batch, or call `model.build(input_shape)` first."
        )
    return model
