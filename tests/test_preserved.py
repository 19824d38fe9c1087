"""Unit tests of `kmix._preserved.Preserved`: what is put back, and when, per `undo=` / `saved=` / `storage=`,
against the state saved by hand (classes, attribute dicts, policies, dtypes, NumPy copies of the values)."""

import os
import signal
import warnings

import keras
import numpy as np
import pytest

from kmix import _compat, _state
from kmix._preserved import Preserved, _ExitGuard


class _Swapped(keras.layers.Dense):
    """A class a layer is switched to inside the block (as autocast swaps a Softmax for kmix's)."""


def _model():
    """`d1` (its own policy) -> `d2` (a policy map it shares with nobody): a functional model, built."""
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(3, name="d1")(x)
    model = keras.Model(x, keras.layers.Dense(2, name="d2", dtype=policy_map)(h), name="m")
    rng = np.random.default_rng(0)
    for v in model.variables:
        v.assign(rng.standard_normal(v.shape).astype("float32"))
    return model


def _by_hand(model):
    """What the test itself saves: each layer's class, attribute dict (identities) and policy; each variable's
    dtype, storage object and value; each graph node's arguments; the policy map's entries; the kmix records."""
    layers = [model, model.get_layer("d1"), model.get_layer("d2")]
    nodes = _compat.graph_nodes(model)
    return {
        "classes": [type(layer) for layer in layers],
        "attributes": [dict(vars(layer)) for layer in layers],
        "policies": [layer.dtype_policy for layer in layers],
        "map": dict(model.get_layer("d2").dtype_policy._policy_map),
        "dtypes": [v.dtype for v in model.variables],
        "storage": [vars(v)["_value"] for v in model.variables],
        "values": [v.numpy().copy() for v in model.variables],
        "nodes": [node.arguments for node in nodes],
        "records": [getattr(v, _state.ATTRIBUTE, None) for v in model.variables],
    }


def _assert_same(before, after):
    assert after["classes"] == before["classes"]
    for got, want in zip(after["attributes"], before["attributes"]):
        assert got.keys() == want.keys() and all(got[k] is want[k] for k in want)
    assert all(a is b for a, b in zip(after["policies"], before["policies"]))
    assert after["map"].keys() == before["map"].keys() and all(after["map"][k] is before["map"][k]
                                                               for k in before["map"])
    assert after["dtypes"] == before["dtypes"]
    assert all(a is b for a, b in zip(after["storage"], before["storage"]))
    for got, want in zip(after["values"], before["values"]):
        np.testing.assert_array_equal(got, want)
    assert all(a is b for a, b in zip(after["nodes"], before["nodes"]))
    assert after["records"] == before["records"]


def _change_everything(model):
    """Every kind of change autocast makes: class, policy, policy map entry in place, attribute, storage, values,
    a graph node's arguments, records."""
    d1, d2 = model.get_layer("d1"), model.get_layer("d2")
    _compat.set_class(d1, _Swapped)
    d1.dtype_policy = "mixed_bfloat16"
    d2.dtype_policy = "mixed_float16"  # Keras writes it into d2's map, in place
    d2.note = "added"
    _compat.recast_variable(d1.kernel, "bfloat16")
    d2.kernel.assign(np.zeros(d2.kernel.shape, "float32"))
    node = _compat.graph_nodes(model)[-1]
    _compat.set_node_arguments(node, *_compat.node_call(node)[1:])
    _state.record_model(model, level="O2-bfloat16")
    after = _by_hand(model)
    assert after["classes"][1] is _Swapped and after["dtypes"][0] == "bfloat16" and "d2" in after["map"]
    return after


def _assert_all_changed(before, after):
    """The changes did take (the test of putting back could not pass by the changes never happening)."""
    assert after["classes"] != before["classes"] and after["dtypes"] != before["dtypes"]
    assert after["map"].keys() != before["map"].keys() and after["records"] != before["records"]
    assert not np.array_equal(after["values"][2], before["values"][2])
    assert any(a is not b for a, b in zip(after["nodes"], before["nodes"]))


@pytest.mark.parametrize("undo", ["always", "on_error"])
def test_an_exception_puts_back_every_class_attribute_policy_storage_value_node_and_record(undo):
    model = _model()
    before = _by_hand(model)
    with pytest.raises(RuntimeError, match="boom"):  # the error raised in the block is the one that propagates
        with Preserved(model, saved="all", storage=True, undo=undo):
            changed = _change_everything(model)
            raise RuntimeError("boom")
    _assert_all_changed(before, changed)
    _assert_same(before, _by_hand(model))
    x = np.linspace(-1.0, 1.0, 8).reshape(2, 4)
    got = keras.ops.convert_to_numpy(model(x.astype("float32")))
    assert got.dtype == np.float32  # computes in float32 again
    want, scale = _model_output(before, x)
    assert np.abs(got - want).max() <= 16 * np.finfo(np.float32).eps * scale.max()


def _model_output(state, x):
    """The model's output from the values saved by hand in float64 NumPy (d1 -> d2, no activation), and the sum
    of the terms' magnitudes (what float32 rounding is relative to)."""
    k1, b1, k2, b2 = (np.asarray(v, np.float64) for v in state["values"])
    h, h_abs = x @ k1 + b1, np.abs(x) @ np.abs(k1) + np.abs(b1)
    return h @ k2 + b2, h_abs @ np.abs(k2) + np.abs(b2)


def test_a_keyboard_interrupt_puts_back_too():
    model = _model()
    before = _by_hand(model)
    with pytest.raises(KeyboardInterrupt):
        with Preserved(model, saved="all", storage=True, undo="on_error"):
            _change_everything(model)
            raise KeyboardInterrupt
    _assert_same(before, _by_hand(model))


def test_undo_always_puts_back_on_a_clean_exit_and_on_error_keeps_the_changes():
    model = _model()
    before = _by_hand(model)
    with Preserved(model, saved="all", storage=True, undo="always"):
        _change_everything(model)
    _assert_same(before, _by_hand(model))
    with Preserved(model, saved="all", storage=True, undo="on_error"):
        changed = _change_everything(model)
    _assert_all_changed(before, changed)
    _assert_same(changed, _by_hand(model))


def test_commit_keeps_the_changes_even_when_an_exception_follows():
    for undo in ("on_error", "always"):
        model = _model()
        before = _by_hand(model)
        with pytest.raises(ValueError):
            with Preserved(model, saved="all", storage=True, undo=undo) as kept:
                changed = _change_everything(model)
                kept.commit()
                raise ValueError("after the commit")
        _assert_all_changed(before, changed)
        _assert_same(changed, _by_hand(model))


def test_restore_variables_and_restore_layers_inside_the_block_put_back_at_once():
    """The docstring's use: back to the values (and layers) on entry while still inside; nothing lost."""
    model = _model()
    before = _by_hand(model)
    d1 = model.get_layer("d1")
    with Preserved(model, saved="all") as kept:
        for v in model.variables:
            v.assign(v + 1.0)
        d1.note, d1.dtype_policy = 1, "mixed_float16"
        assert kept.restore_variables() == []
        for got, want in zip([v.numpy() for v in model.variables], before["values"]):
            np.testing.assert_array_equal(got, want)
        kept.restore_layers()
        assert not hasattr(d1, "note") and d1.dtype_policy is before["policies"][1]
        model.get_layer("d2").kernel.assign(np.zeros((3, 2), "float32"))  # changed again: put back on exit
    _assert_same(before, _by_hand(model))


def test_records_are_put_back_without_storage_too():
    """With `storage=False` the variables' own attributes are not kept: the records are put back by themselves
    (one written before the block kept, those written inside taken off)."""
    model = _model()
    kernel = model.get_layer("d1").kernel
    old = _state.Placed("float32", "O0")
    setattr(kernel, _state.ATTRIBUTE, old)
    with pytest.raises(RuntimeError):
        with Preserved(model, saved="none", storage=False, undo="on_error"):
            _state.record_model(model, level="O1-float16")
            assert len(_state.placed(model.variables)) == 4
            raise RuntimeError
    assert [getattr(v, _state.ATTRIBUTE, None) for v in model.variables] == [old, None, None, None]
    assert getattr(kernel, _state.ATTRIBUTE) is old


def test_saved_none_neither_restores_nor_checks_values_but_puts_layers_back():
    model = _model()
    before = _by_hand(model)
    d1 = model.get_layer("d1")
    with Preserved(model, saved="none") as kept:
        assert os.listdir(kept._dir) == []  # no value written
        for v in model.variables:
            v.assign(v * 2.0)
        d1.dtype_policy = "mixed_bfloat16"
    assert d1.dtype_policy is before["policies"][1]
    for got, want in zip([v.numpy() for v in model.variables], before["values"]):
        np.testing.assert_array_equal(got, want * 2.0)


def test_a_change_without_a_copy_is_a_warning_when_an_error_is_in_flight():
    """`saved="non-trainable"` copies no trainable value: a trainable one changed is named in a warning, and the
    block's own error is the one raised; the non-trainable one changed is put back."""
    model = _model()
    d2 = model.get_layer("d2")
    d2.trainable = False
    before = _by_hand(model)
    d1_kernel = model.get_layer("d1").kernel
    with pytest.warns(UserWarning, match=f"changed where kmix kept no copy.*{d1_kernel.path}"):
        with pytest.raises(OSError, match="in the block"):
            with Preserved(model, saved="non-trainable") as kept:
                assert sorted(os.listdir(kept._dir)) == ["2.npy", "3.npy"]  # d2's kernel and bias only
                for v in model.variables:
                    v.assign(v + 1.0)
                raise OSError("in the block")
    values = [v.numpy() for v in model.variables]
    np.testing.assert_array_equal(values[0], before["values"][0] + 1.0)  # no copy: left as it is
    np.testing.assert_array_equal(values[2], before["values"][2])


def test_the_temporary_directory_is_removed_and_the_sigint_handler_put_back_on_every_exit():
    model = _model()
    handler = signal.getsignal(signal.SIGINT)
    for undo, error in (("always", None), ("on_error", None), ("on_error", RuntimeError)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                with Preserved(model, saved="all", undo=undo) as kept:
                    directory = kept._dir
                    assert os.path.isdir(directory) and len(os.listdir(directory)) == len(model.variables)
                    assert signal.getsignal(signal.SIGINT) != handler
                    if error:
                        raise error("x")
            except RuntimeError:
                assert error is RuntimeError
        assert not os.path.exists(directory), (undo, error)
        assert signal.getsignal(signal.SIGINT) is handler, (undo, error)


def test_saved_must_be_one_of_the_three():
    for saved in Preserved.SAVED:
        Preserved(keras.Sequential(), saved=saved)
    with pytest.raises(ValueError, match=r"`saved` must be one of \('all', 'non-trainable', 'none'\). "
                                         r"Received: saved='trainable'"):
        Preserved(keras.Sequential(), saved="trainable")


def test_an_empty_model_enters_and_exits_cleanly():
    model = keras.Sequential([], name="empty")
    with pytest.raises(RuntimeError):
        with Preserved(model, saved="all", storage=True, undo="on_error") as kept:
            assert os.listdir(kept._dir) == []
            raise RuntimeError
    with Preserved(model, saved="non-trainable"):
        pass
    assert model.layers == []


def test_the_exit_guard_defers_a_sigint_while_holding_and_raises_it_on_close():
    """Outside the exit a Ctrl-C interrupts at once; while `holding` it waits for `close`, which also puts the
    previous handler back. The test starts from Python's own handler with SIGINT unblocked, whatever an earlier
    test in this worker process left (a Ctrl-C raised nothing here once, in one xdist worker of a full run)."""
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    state = f"found: handler {outer!r}, blocked {sorted(blocked)}, pending {sorted(signal.sigpending())}"
    guard = _ExitGuard()
    try:
        assert signal.getsignal(signal.SIGINT) == guard._handle
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        else:
            pytest.fail(f"a Ctrl-C outside the exit raised nothing ({state})")
        guard.holding = True
        signal.raise_signal(signal.SIGINT)  # deferred: no exception here
        assert guard.received == [signal.SIGINT], state
    finally:
        try:
            with pytest.raises(KeyboardInterrupt, match="deferred while kmix put the model back"):
                guard.close()
        finally:
            # None: the handler found was set outside Python.
            handler = signal.signal(signal.SIGINT, signal.SIG_DFL if outer is None else outer)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    assert handler is signal.default_int_handler and guard.received == [], state
    guard.close()  # a second close: nothing left to raise or put back
