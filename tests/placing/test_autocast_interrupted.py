"""`kmix.autocast` and `kmix.export` are all or nothing: an interrupt at any call point leaves the model as it was.

A KeyboardInterrupt is injected at the n-th call of a function in kmix's own code while
autocast runs (sys.settrace), for n spread over every call it makes. The reference is the
model before the call: weights bitwise with their dtypes, each layer's class and policy
object, its compiled `predict_function`, no call wrapper left, and its predictions
(`predict_on_batch`: that same `predict_function`, without `predict`'s 0.15 s of setup a call).
"""

import signal
import sys

import keras
import numpy as np
import pytest

import kmix
from kmix import _preserved
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
    """A tracer raising KeyboardInterrupt at the `at`-th call into kmix's code (counting only, with None).

    At the entry of `Preserved.__exit__`, where no code of it has run and so no error can be raised, it
    sends a real Ctrl-C (SIGINT) instead: only a signal can land there.
    """

    def __init__(self, at=None):
        self.at, self.calls = at, 0

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(KMIX):
            self.calls += 1
            if self.calls == self.at:
                if frame.f_code is _preserved.Preserved.__exit__.__code__:
                    signal.raise_signal(signal.SIGINT)  # delivered as __exit__ starts
                    return None
                raise KeyboardInterrupt(f"injected at call {self.at}: {frame.f_code.co_name}")
        return None


def _interrupted(call):
    """Whether `call` raised the injected KeyboardInterrupt.

    An interrupt that lands in a generator's finalizer (its close is a call too)
    is dropped by Python ("Exception ignored in"), as a real Ctrl-C there would
    be: the call then finishes.
    """
    try:
        call()
    except KeyboardInterrupt:
        return True
    return False


def _run(model, level, tracer):
    sys.settrace(tracer)
    try:
        kmix.autocast(model, level)
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_interrupt_anywhere_leaves_the_model_as_it_was(level):
    """Interrupted at each call point, the model is as it was; so the next point reuses it (an interrupted
    model autocasts with the same calls as a fresh one), and only a model autocast to the end is built anew."""
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    counter = _Interrupt()
    for tracer in (None, counter):  # the first run's one-time work (caches, imports) out of the count
        model = _model()
        model.predict(x, verbose=0)  # as below: a model with a compiled predict function
        _run(model, level, tracer)
    placed = _placement(model)
    # 300 call points spread over the call under KMIX_FULL_TESTS (about 4,300 calls in all), 12 otherwise.
    points = sorted({int(p) for p in np.linspace(1, counter.calls, 300 if FULL else 12)})
    model = None
    for at in points:
        if model is None:  # a fresh model: its predictions and state are the reference
            model = _model()
            model.predict(x, verbose=0)  # as above: a model with a compiled predict function
            expected = model.predict_on_batch(x)  # through that function, as after each interrupt
            before = _state(model)
        if not _interrupted(lambda: _run(model, level, _Interrupt(at))) or _placement(model) == placed:
            assert _placement(model) == placed, at  # it finished: interrupted on the way out, or not at all
            model = None
            continue
        after = _state(model)
        assert after[0] == before[0], f"weights changed by an interrupt at call {at}"
        assert all(a[0] is b[0] and a[1] is b[1] and not a[2] for a, b in zip(after[1], before[1])), at
        assert after[2] is before[2], at
        np.testing.assert_array_equal(model.predict_on_batch(x), expected)


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


def _export(model, path, x, tracer):
    sys.settrace(tracer)
    try:
        kmix.export(model, path, sample=x, verbose=False)
    finally:
        sys.settrace(None)


def test_an_interrupt_anywhere_in_export_leaves_the_model_as_it_was_and_no_partial_artifact(tmp_path):
    """export places a bfloat16 copy of the model's computation and puts the model back: interrupted anywhere,
    the model is as before (weights bitwise, policies, predict function, no wrapper) and the path holds
    nothing or a whole artifact that serves the model's predictions."""
    import os

    import tensorflow as tf

    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    # One model for every run: export leaves it as it was (checked after each run, against its state before
    # the first), so each run starts alike.
    model = _model()
    model.predict(x, verbose=0)
    expected = model.predict_on_batch(x)  # through the compiled predict function, as after each export
    before = _state(model)
    counter = _Interrupt()
    for index, tracer in enumerate((None, counter)):  # the first run's one-time work out of the count
        _export(model, str(tmp_path / f"count{index}"), x, tracer)
    # 300 call points spread over the call under KMIX_FULL_TESTS, 8 otherwise.
    points = sorted({int(p) for p in np.linspace(1, counter.calls, 300 if FULL else 8)})
    for at in points:
        path = str(tmp_path / f"served{at}")
        if not _interrupted(lambda: _export(model, path, x, _Interrupt(at))):
            assert os.path.exists(path), at  # it finished: the artifact is checked below
        after = _state(model)
        assert after[0] == before[0], f"weights changed by an interrupt at call {at}"
        assert all(a[0] is b[0] and a[1] is b[1] and not a[2] for a, b in zip(after[1], before[1])), at
        assert after[2] is before[2], at
        np.testing.assert_array_equal(model.predict_on_batch(x), expected)
        if os.path.exists(path):  # interrupted after the artifact moved in: it is whole
            loaded = tf.saved_model.load(path)  # held: its functions use its variables
            np.testing.assert_allclose(np.asarray(loaded.serve(x), np.float32), expected, atol=0.05)
