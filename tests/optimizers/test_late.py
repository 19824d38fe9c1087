"""A model compiled before `kmix.autocast` placed it in float16: one warning when it would train unscaled.

The reference for each verdict is what the trainer really does: the loss
scale `optimizer.scale_loss` applies in a train step (1 for a plain
optimizer and a fixed-scale-1 `kmix.LossScaleOptimizer`), after one `fit`.
"""

import warnings

import keras
import numpy as np
import pytest

import kmix
from kmix.placing.records import warn_if_unscaled

X = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
Y = X.sum(axis=1, keepdims=True)


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])


def _scale_applied(model):
    """The factor the trainer multiplies the loss by, as `fit`'s train step calls it."""
    return float(keras.ops.convert_to_numpy(model.optimizer.scale_loss(keras.ops.ones(()))))


def _placed(model):
    """`model` placed in O1 by autocast, with any warning autocast itself gives recorded."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kmix.autocast(model, "O1")
    return [str(w.message) for w in caught]


def _warned(model, policy="O1"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned = warn_if_unscaled(model, kmix.Policy(policy))
    messages = [str(w.message) for w in caught if "no loss scaling" in str(w.message)]
    assert returned == bool(messages) and len(messages) <= 1
    return messages[0] if messages else None


def test_plain_optimizer_compiled_before_a_float16_autocast_warns_with_the_fix():
    model = _model()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    _placed(model)
    message = _warned(model)
    assert message is not None
    assert "plain Adam" in message and "float16" in message
    assert "kmix.policy_scope('O1-float16')" in message and "kmix.wrap(keras.optimizers.Adam(...))" in message
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    assert _scale_applied(model) == 1.0  # what the warning says: the step is not scaled
    # Following the advice: dynamic scaling from 2^15, and no warning.
    with kmix.policy_scope("O1-float16"):
        model.compile(optimizer=kmix.wrap(keras.optimizers.Adam(1e-3)), loss="mse")
    assert model.optimizer.dynamic and _scale_applied(model) == 2.0**15
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    assert _scale_applied(model) > 1.0  # from 2^15, halved on any overflow
    assert _warned(model) is None


def test_kmix_wrap_built_with_scale_one_before_the_autocast_warns():
    model = _model()
    model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(0.01)), loss="mse")  # float32: fixed scale 1
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)  # built before the placement
    _placed(model)
    message = _warned(model)
    assert message is not None and "fixed loss scale of 1" in message and "keras.optimizers.SGD" in message
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    assert _scale_applied(model) == 1.0


def test_unbuilt_kmix_wrap_follows_the_model_so_no_warning():
    model = _model()
    model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(0.01)), loss="mse")
    _placed(model)
    assert _warned(model) is None
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0)
    assert model.optimizer.dynamic and _scale_applied(model) > 1.0  # the silence was right: build made it dynamic


@pytest.mark.parametrize("case", ["bfloat16", "uncompiled", "keras_loss_scale", "fixed_scale_chosen"])
def test_no_warning_where_the_loss_is_scaled_or_need_not_be(case):
    model = _model()
    policy = "O1-bfloat16" if case == "bfloat16" else "O1"
    if case == "keras_loss_scale":
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), loss="mse")
    elif case == "fixed_scale_chosen":
        model.compile(optimizer=kmix.wrap(keras.optimizers.SGD(), dynamic=False, initial_scale=1024.0),
                      loss="mse")
    elif case == "bfloat16":
        model.compile(optimizer="sgd", loss="mse")
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0) if case != "uncompiled" else None
    kmix.autocast(model, policy)
    assert _warned(model, policy) is None
    if case in ("keras_loss_scale", "fixed_scale_chosen"):
        assert _scale_applied(model) > 1.0


def test_autocast_itself_warns_once_on_a_plain_compiled_model():
    model = _model()
    model.compile(optimizer="adam", loss="mse")
    messages = [m for m in _placed(model) if "no loss scaling" in m]
    assert len(messages) == 1 and "kmix.wrap" in messages[0]
