"""Unit tests of `kmix._checks`: accepted values pass through in their canonical type; each bad value raises the
documented error type, with a message naming the argument, the value received and what is accepted."""

import math
import re

import keras
import numpy as np
import pytest

from kmix import _checks


def _raises(error, call, *parts):
    """Asserts `call()` raises exactly `error` with every one of `parts` in its message; returns the message."""
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, type(info.value)
    message = str(info.value)
    for part in parts:
        assert part in message, (part, message)
    return message


@pytest.mark.parametrize("value, minimum", [(1, 1), (7, 1), (0, 0), (-3, -5), (np.int64(4), 2), (np.int8(1), 1)])
def test_integer_accepts_integers_at_or_above_the_minimum_as_int(value, minimum):
    got = _checks.integer("steps", value, minimum=minimum)
    assert got == int(value) and type(got) is int


@pytest.mark.parametrize("value", [True, False, 1.0, 2.5, "3", None, np.float32(2)])
def test_integer_rejects_non_integers_and_bools_with_a_type_error(value):
    _raises(TypeError, lambda: _checks.integer("steps", value), "`steps` must be an int >= 1",
            f"Received: steps={value!r}", f"(of type {type(value).__name__})")


@pytest.mark.parametrize("value, minimum", [(0, 1), (-1, 0), (2, 3)])
def test_integer_rejects_values_below_the_minimum_with_a_value_error(value, minimum):
    _raises(ValueError, lambda: _checks.integer("every", value, minimum=minimum),
            f"`every` must be an int >= {minimum}", f"Received: every={value!r}")


def test_boolean_accepts_only_true_and_false():
    assert _checks.boolean("verbose", True) is True and _checks.boolean("verbose", False) is False
    for value in (1, 0, "True", None):
        _raises(TypeError, lambda: _checks.boolean("verbose", value), "`verbose` must be True or False",
                f"Received: verbose={value!r}")


def test_optimizer_passes_an_optimizer_through_and_builds_one_from_a_name_or_config():
    sgd = keras.optimizers.SGD(0.5)
    assert _checks.optimizer(sgd) is sgd
    assert type(_checks.optimizer("adamw")) is keras.optimizers.AdamW
    built = _checks.optimizer({"class_name": "SGD", "config": {"learning_rate": 0.25, "momentum": 0.5}})
    assert type(built) is keras.optimizers.SGD
    assert math.isclose(float(built.learning_rate), 0.25) and built.momentum == 0.5


def test_optimizer_rejects_an_unknown_name_or_config_with_a_value_error():
    message = _raises(ValueError, lambda: _checks.optimizer("no_such_optimizer"), "`optimizer` names no Keras "
                      "optimizer", "Received: optimizer='no_such_optimizer'")
    assert re.search(r"\((ValueError|TypeError): ", message), message  # Keras's own reason, named
    _raises(ValueError, lambda: _checks.optimizer({"class_name": "NoSuchOptimizer", "config": {}}),
            "`optimizer` names no Keras optimizer", "Received: optimizer={'class_name': 'NoSuchOptimizer'")


@pytest.mark.parametrize("value", [None, 0.1, keras.optimizers.SGD, ["adam"]])
def test_optimizer_rejects_other_types_with_a_type_error_saying_what_is_accepted(value):
    _raises(TypeError, lambda: _checks.optimizer(value), "`optimizer` must be a Keras optimizer",
            "its name", "config dict", f"Received: optimizer={value!r} of type {type(value).__name__}")


@pytest.mark.parametrize("value, bounds, expected", [
    (2, {}, 2.0),
    (np.float32(0.5), {"low": 0, "high": 1}, 0.5),
    (0, {"low": 0}, 0.0),                       # a closed bound is inside
    (1, {"low": 0, "high": 1}, 1.0),
    (-7.5, {"high": 0, "high_open": True}, -7.5),
    (math.inf, {"low": 1, "allow_inf": True}, math.inf),
    (-math.inf, {"allow_inf": True}, -math.inf),
])
def test_real_accepts_numbers_within_the_bounds_as_float(value, bounds, expected):
    got = _checks.real("factor", value, **bounds)
    assert got == expected and type(got) is float


@pytest.mark.parametrize("value", [True, "1.0", None, [1.0], 1 + 0j])
def test_real_rejects_non_reals_and_bools_with_a_type_error(value):
    _raises(TypeError, lambda: _checks.real("factor", value), "`factor` must be a real number",
            f"Received: factor={value!r}", f"(of type {type(value).__name__})")


@pytest.mark.parametrize("value, allow_inf", [(math.nan, False), (math.nan, True), (math.inf, False),
                                              (-math.inf, False), (np.float64("nan"), True)])
def test_real_rejects_nan_always_and_inf_unless_allowed(value, allow_inf):
    _raises(ValueError, lambda: _checks.real("factor", value, allow_inf=allow_inf), "`factor` must be finite",
            f"Received: factor={value!r}")


@pytest.mark.parametrize("value, bounds, accepted", [
    (1.0, {"low": 1, "low_open": True}, "> 1"),
    (0.5, {"low": 1}, ">= 1"),
    (2.0, {"high": 2, "high_open": True}, "< 2"),
    (2.5, {"high": 2}, "<= 2"),
    (0.0, {"low": 0, "high": 1, "low_open": True}, "in the interval (0, 1]"),
    (1.0, {"low": 0, "high": 1, "high_open": True}, "in the interval [0, 1)"),
    (-0.1, {"low": 0, "high": 1}, "in the interval [0, 1]"),
    (3.0, {"low": 0.5, "high": 2.5, "low_open": True, "high_open": True}, "in the interval (0.5, 2.5)"),
])
def test_real_rejects_values_out_of_bounds_saying_the_interval(value, bounds, accepted):
    _raises(ValueError, lambda: _checks.real("growth_factor", value, **bounds),
            f"`growth_factor` must be {accepted}. Received: growth_factor={value!r}")


def test_wrapped_layer_takes_a_layer_or_its_config_and_rejects_the_rest():
    dense = keras.layers.Dense(3, name="inner")
    assert _checks.wrapped_layer(dense) is dense
    revived = _checks.wrapped_layer(keras.saving.serialize_keras_object(dense))
    assert type(revived) is keras.layers.Dense and revived is not dense and revived.get_config() == dense.get_config()
    for value in (None, "dense", keras.layers.Dense):
        _raises(TypeError, lambda: _checks.wrapped_layer(value), "`layer` must be a keras.layers.Layer",
                f"Received: layer={value!r} (of type {type(value).__name__})")


def test_built_model_accepts_a_built_model_and_rejects_a_layer_with_a_type_error():
    x = keras.Input((4,))
    model = keras.Model(x, keras.layers.Dense(2)(x), name="graph")
    assert _checks.built_model(model) is model
    layer = keras.layers.Dense(2)
    _raises(TypeError, lambda: _checks.built_model(layer), "`model` must be a keras.Model",
            f"Received: model={layer!r} (of type Dense)")


class _TwoParts(keras.Model):
    """A subclassed model never called: built only if its parts are built by hand (keras.io's VAE)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.encoder = keras.layers.Dense(2, name="encoder")
        self.decoder = keras.layers.Dense(4, name="decoder")

    def call(self, x):
        return self.decoder(self.encoder(x))


def test_built_model_rejects_an_unbuilt_model_unless_its_built_layers_may_stand_in():
    model = _TwoParts(name="vae")
    for stand_in in (False, True):  # nothing built: rejected either way
        _raises(ValueError, lambda: _checks.built_model(model, layers_may_stand_in=stand_in),
                "`model` must be built", "Received: model 'vae' (_TwoParts), not built", "keras.Input(shape)")
    model.encoder.build((None, 4))
    _raises(ValueError, lambda: _checks.built_model(model, layers_may_stand_in=True), "must be built")  # half built
    model.decoder.build((None, 2))
    assert not model.built
    assert _checks.built_model(model, layers_may_stand_in=True) is model
    _raises(ValueError, lambda: _checks.built_model(model), "must be built")
    empty = keras.Sequential([], name="empty")  # no layer at all stands in for nothing
    assert not empty.built
    _raises(ValueError, lambda: _checks.built_model(empty, layers_may_stand_in=True), "'empty' (Sequential)")


def test_real_rejects_an_int_too_large_for_a_float_naming_the_argument():
    _raises(ValueError, lambda: _checks.real("factor", 10 ** 400), "`factor`", "Received: factor=")
