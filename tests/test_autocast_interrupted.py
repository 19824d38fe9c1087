"""`kmix.autocast` is all or nothing: an interrupt at any call point leaves the model exactly as it was.

A KeyboardInterrupt is injected at the n-th call of a function in kmix's own code while
autocast runs (sys.settrace), for n spread over every call it makes. The reference is the
model before the call: weights bitwise with their dtypes, each layer's class and policy
object, its compiled `predict_function`, no call wrapper left, and its predictions.
"""

import sys

import keras
import numpy as np
import pytest

import kmix
from tests.testing import FULL

KMIX = kmix.__file__.rsplit("/", 1)[0]


def _model():
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(x)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.BatchNormalization()(h)
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    s = keras.layers.Reshape((4, 4))(h)
    h = keras.layers.Flatten()(attention(s, s))
    return keras.Model(x, keras.layers.Dense(3, activation="softmax")(h))


def _state(model):
    return ([(v.path, keras.backend.standardize_dtype(v.dtype), np.asarray(v.numpy()).tobytes()) for v in model.weights],
            [(type(layer), layer.dtype_policy, "call" in vars(layer)) for layer in model._flatten_layers()],
            model.predict_function)


def _placement(model):
    """What a finished autocast leaves, by value: weights with dtypes, classes and policy names."""
    weights, layers, _ = _state(model)
    return ([(dtype, value) for _, dtype, value in weights],  # paths differ: each model numbers its layers anew
            [(cls.__name__, policy.name, wrapped) for cls, policy, wrapped in layers])


class _Interrupt:
    """A tracer raising KeyboardInterrupt at the `at`-th call into kmix's code (counting only, with None)."""

    def __init__(self, at=None):
        self.at, self.calls = at, 0

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(KMIX):
            self.calls += 1
            if self.calls == self.at:
                raise KeyboardInterrupt(f"injected at call {self.at}: {frame.f_code.co_name}")
        return None


def _run(model, level, tracer):
    sys.settrace(tracer)
    try:
        kmix.autocast(model, level)
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_interrupt_anywhere_leaves_the_model_as_it_was(level):
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    counter = _Interrupt()
    for tracer in (None, counter):  # the first run's one-time work (caches, imports) out of the count
        model = _model()
        model.predict(x, verbose=0)  # as below: a model with a compiled predict function
        _run(model, level, tracer)
    placed = _placement(model)
    # 300 call points spread over the call under KMIX_FULL_TESTS (about 4,300 calls in all), 12 otherwise.
    points = sorted({int(p) for p in np.linspace(1, counter.calls, 300 if FULL else 12)})
    for at in points:
        model = _model()
        expected = model.predict(x, verbose=0)
        before = _state(model)
        with pytest.raises(KeyboardInterrupt):
            _run(model, level, _Interrupt(at))
            print(f"autocast returned without reaching call {at}")
        after = _state(model)
        if _placement(model) == placed:  # interrupted on the way out, after autocast's last change
            continue
        assert after[0] == before[0], f"weights changed by an interrupt at call {at}"
        assert all(a[0] is b[0] and a[1] is b[1] and not a[2] for a, b in zip(after[1], before[1])), at
        assert after[2] is before[2], at
        np.testing.assert_array_equal(model.predict(x, verbose=0), expected)


def test_a_ctrl_c_while_export_puts_the_model_back_waits_until_it_is_back(tmp_path, monkeypatch):
    """SIGINT during `Preserved`'s restore is raised after it: the model is whole, then the interrupt."""
    import os
    import signal

    from kmix import _compat

    model = _model()
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    expected = model.predict(x, verbose=0)
    before = _state(model)
    restore = _compat.restore_object_state
    calls = []

    def interrupted_restore(obj, state):
        if not calls:
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C as the first object is put back
        calls.append(obj)
        return restore(obj, state)

    monkeypatch.setattr(_compat, "restore_object_state", interrupted_restore)
    with pytest.raises(KeyboardInterrupt, match="deferred"):
        kmix.export(model, str(tmp_path / "served"), sample=x, verbose=False)
    after = _state(model)
    assert after[0] == before[0] and after[2] is before[2]
    assert all(a[0] is b[0] and a[1] is b[1] and not a[2] for a, b in zip(after[1], before[1]))
    np.testing.assert_array_equal(model.predict(x, verbose=0), expected)
