"""Unit tests of `kmix._state`: the active kmix policy (per thread, dropped when Keras's global policy moves on)
and the `Placed` records autocast writes on trainable variables, against values written down by hand."""

import dataclasses
import threading

import keras
import pytest

from kmix import _state


def test_active_policy_is_the_one_set_while_keras_keeps_the_policy_it_set():
    """A stand-in object as the kmix policy: `_state` only stores it; the Keras policy name decides if it holds."""
    kmix_policy = object()
    keras.config.set_dtype_policy("mixed_bfloat16")
    _state.restore((None, None))
    assert _state.active_policy() is None  # never set
    _state.set_active(kmix_policy, "mixed_bfloat16")
    assert _state.active_policy() is kmix_policy
    keras.config.set_dtype_policy("float32")  # Keras's policy changed behind kmix's back
    assert _state.active_policy() is None
    keras.config.set_dtype_policy("mixed_bfloat16")  # and back: the record holds again
    assert _state.active_policy() is kmix_policy
    _state.set_active(kmix_policy, "mixed_float16")  # recorded for another Keras policy than the one in force
    assert _state.active_policy() is None


def test_save_and_restore_round_trip_and_leave_keras_alone():
    first, second = object(), object()
    keras.config.set_dtype_policy("mixed_float16")
    _state.set_active(first, "mixed_float16")
    saved = _state.save()
    assert saved == (first, "mixed_float16")
    _state.set_active(second, "float32")
    keras.config.set_dtype_policy("float32")
    assert _state.active_policy() is second
    _state.restore(saved)
    assert keras.config.dtype_policy().name == "float32"  # Keras's own policy is not touched
    assert _state.save() == (first, "mixed_float16") and _state.active_policy() is None
    keras.config.set_dtype_policy("mixed_float16")
    assert _state.active_policy() is first
    _state.restore((None, None))
    assert _state.save() == (None, None) and _state.active_policy() is None


def test_the_active_policy_is_kept_per_thread():
    """Another thread sees none and sets its own; this thread's stays (as Keras keeps its global policy per thread)."""
    mine, theirs = object(), object()
    _state.set_active(mine, keras.config.dtype_policy().name)
    seen = {}

    def other():
        seen["before"] = _state.save()
        _state.set_active(theirs, keras.config.dtype_policy().name)
        seen["after"] = _state.save()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen["before"] == (None, None) and seen["after"][0] is theirs
    assert _state.active_policy() is mine


def test_placed_is_a_frozen_record_with_no_scale_by_default():
    record = _state.Placed("bfloat16", "O2-bfloat16")
    assert (record.compute_dtype, record.level, record.initial_scale) == ("bfloat16", "O2-bfloat16", None)
    assert record == _state.Placed("bfloat16", "O2-bfloat16", None) != _state.Placed("bfloat16", "O2-bfloat16", 2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.level = "O1"


class _Scaled(keras.Model):
    """A subclassed model: a variable of its own, a bfloat16 Dense and a float32 frozen Dense inside."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.half = keras.layers.Dense(3, dtype="mixed_bfloat16", name="half")
        self.frozen = keras.layers.Dense(2, name="frozen", trainable=False)

    def build(self, input_shape):
        self.half.build(input_shape)
        self.frozen.build((None, 3))
        self.gain = self.add_weight(name="gain", shape=(), initializer="ones")

    def call(self, x):
        return self.frozen(self.half(x)) * self.gain


def _model():
    model = _Scaled(name="scaled")
    model.build((None, 4))
    return model


def test_record_model_writes_the_innermost_owners_compute_dtype_on_each_trainable_variable():
    """Expected by hand: the Dense's kernel and bias compute in bfloat16, the model's own `gain` in float32;
    the frozen Dense's variables get no record."""
    model = _model()
    _state.record_model(model, initial_scale=2 ** 15, level="O1-bfloat16")
    expected = {
        "scaled/half/kernel": _state.Placed("bfloat16", "O1-bfloat16", 32768.0),
        "scaled/half/bias": _state.Placed("bfloat16", "O1-bfloat16", 32768.0),
        "scaled/gain": _state.Placed("float32", "O1-bfloat16", 32768.0),
    }
    got = {v.path: getattr(v, _state.ATTRIBUTE, None) for v in model.variables}
    assert {path: record for path, record in got.items() if record is not None} == expected
    assert {path for path, record in got.items() if record is None} == {"scaled/frozen/kernel", "scaled/frozen/bias"}
    assert type(getattr(model.gain, _state.ATTRIBUTE).initial_scale) is float  # an int scale is stored as a float


def test_record_model_without_a_scale_and_placed_reads_records_back_in_order():
    model = _model()
    _state.record_model(model, level="O0")
    records = _state.placed(model.variables)  # the frozen Dense's two variables have none: left out
    ordered = [v for v in model.variables if v.trainable]
    assert records == [getattr(v, _state.ATTRIBUTE) for v in ordered]
    assert [r.compute_dtype for r in records] == [{"scaled/gain": "float32"}.get(v.path, "bfloat16") for v in ordered]
    assert {(r.level, r.initial_scale) for r in records} == {("O0", None)}
    assert _state.placed(model.non_trainable_variables) == [] and _state.placed([]) == []


def test_snapshot_and_restore_records_round_trip():
    """Records written after the snapshot are taken off again, those before put back, the unrecorded left bare."""
    model = _model()
    kernel, bias, gain = model.half.kernel, model.half.bias, model.gain
    old = _state.Placed("float32", "O0")
    setattr(kernel, _state.ATTRIBUTE, old)
    saved = _state.snapshot(model.variables)
    assert [(v.path, record) for v, record in saved] == [
        (v.path, old if v is kernel else None) for v in model.variables]
    _state.record_model(model, initial_scale=4.0, level="O2-bfloat16")
    assert getattr(kernel, _state.ATTRIBUTE) != old and hasattr(bias, _state.ATTRIBUTE)
    _state.restore_records(saved)
    assert getattr(kernel, _state.ATTRIBUTE) is old
    assert not hasattr(bias, _state.ATTRIBUTE) and not hasattr(gain, _state.ATTRIBUTE)
    _state.restore_records(saved)  # twice: the same, no error for an attribute already gone
    assert _state.placed(model.variables) == [old]
