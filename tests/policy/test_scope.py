"""set_policy / policy_scope / active_policy: what they set and what they restore."""

import threading
import warnings

import keras
import numpy as np
import pytest

import kmix
from kmix.optimizers import scaling
from kmix import _state
from kmix.policy import Policy, active_policy, policy_scope, set_policy


def test_set_policy_sets_keras_and_kmix():
    p = set_policy("O2", half="bfloat16")
    assert p == Policy("O2", half="bfloat16")
    assert keras.config.dtype_policy().name == "bfloat16"
    assert active_policy() is p
    assert keras.layers.Dense(2).dtype_policy.variable_dtype == "bfloat16"


def test_active_policy_is_none_before_and_after_keras_changes():
    assert active_policy() is None
    set_policy("O1")
    assert active_policy() == Policy("O1")
    keras.config.set_dtype_policy("float32")
    assert active_policy() is None


def test_auto_master_weights_follows_the_policy():
    # O2 and O3 set the same Keras policy; only kmix's state tells them apart.
    set_policy("O2")
    assert scaling.auto_master_weights() is True
    set_policy("O3")
    assert scaling.auto_master_weights() is False
    set_policy("O1")
    assert scaling.auto_master_weights() is True  # float32 params: nothing to copy, harmless


def test_scope_restores_previous_state():
    set_policy("O1")
    outer_keras = keras.config.dtype_policy()
    with policy_scope("O3", half="bfloat16") as p:
        assert p == Policy("O3", half="bfloat16")
        assert keras.config.dtype_policy().name == "bfloat16"
        assert active_policy() is p
        with policy_scope("float32"):
            assert active_policy() == Policy("float32")
        assert active_policy() is p
    assert keras.config.dtype_policy() is outer_keras
    assert active_policy() == Policy("O1")


def test_scope_restores_on_exception():
    keras.config.set_dtype_policy("mixed_bfloat16")  # set by plain Keras: kmix has none
    with pytest.raises(RuntimeError, match="boom"):
        with policy_scope("O2"):
            assert active_policy() == Policy("O2")
            raise RuntimeError("boom")
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert active_policy() is None


def test_scope_with_bad_spec_changes_nothing():
    set_policy("O1")
    saved = _state.save()
    with pytest.raises(ValueError, match="'O9'"):
        with policy_scope("O9"):
            pass  # pragma: no cover
    assert keras.config.dtype_policy().name == "mixed_float16"
    assert _state.save() == saved


def test_state_is_per_thread_like_keras():
    set_policy("O2")
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(p=active_policy(), k=keras.config.dtype_policy().name))
    thread.start()
    thread.join()
    assert seen == {"p": None, "k": "float32"}
    assert active_policy() == Policy("O2")


def test_exported_from_kmix():
    assert kmix.policy.set_policy is set_policy


def test_global_o1_o2_warn_once_and_say_what_a_model_built_there_does(monkeypatch):
    from kmix.policy import scope

    monkeypatch.setattr(scope, "_WARNED", set())
    with pytest.warns(UserWarning, match=r"set_policy\('O2'\).*'float16'.*kmix.autocast\(model, 'O2'\)"):
        set_policy("O2")
    inputs = keras.Input((4,))
    h = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(4)(inputs))
    built_under_o2 = keras.Model(inputs, keras.layers.Dense(2)(h))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_policy("O2")  # once only
        set_policy("O3")  # pure half: what Keras's policy gives is the whole of O3
        with policy_scope("O1"):  # scoped: the route for compiling an autocast model
            pass
    # What the warning says: every layer half, batch norm and outputs included ...
    assert {v.dtype for v in built_under_o2.get_layer("bn").weights} == {"float16"}
    assert built_under_o2.output.dtype == "float16"
    # ... while autocast gives the level's placement, outputs in Policy.output_dtype.
    set_policy("float32")
    fresh = keras.Model.from_config(built_under_o2.get_config())
    placed = kmix.autocast(fresh, "O2")
    assert {v.dtype for v in placed.get_layer("bn").weights} == {"float32"}
    out = placed(np.ones((2, 4), "float32"))
    assert keras.backend.standardize_dtype(out.dtype) == Policy("O2").output_dtype == "float32"


def test_scope_o1_warns_once_when_layers_are_built_inside_like_set_policy(monkeypatch):
    """Built inside `policy_scope("O1")`, a model gets half batch norm: the scope says so, once."""
    from kmix.policy import scope

    monkeypatch.setattr(scope, "_WARNED", set())
    keras.utils.set_random_seed(0)
    reference = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.BatchNormalization()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with policy_scope("O1"):  # compiling (and wrapping) inside builds no layer: silent
            reference.compile(optimizer=kmix.wrap("sgd"), loss="mse")
    with pytest.warns(UserWarning, match=r"Layers built inside kmix.policy_scope\('O1'\) took Keras's "
                                         r"policy 'mixed_float16'.*kmix.autocast\(model, 'O1'\)") as record:
        with policy_scope("O1"):
            inputs = keras.Input((4,))
            built = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(4)(inputs)))
    assert record[0].filename == __file__  # points at the user's `with`
    # What it warns about, checked against a model built outside: half statistics there.
    assert built.get_layer("bn").compute_dtype == "float16"
    assert reference.layers[1].compute_dtype == "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with policy_scope("O1"):  # once per level, shared with set_policy
            keras.layers.Dense(2)
        set_policy("O1")
    with pytest.warns(UserWarning, match=r"policy_scope\('O2'\)"):
        with policy_scope("O2"):
            keras.layers.Dense(2)


def test_concurrent_scopes_in_threads_nest_raise_and_restore_independently():
    """Issue 39 item 8: two threads nesting scopes at once, one raising, never see each other's policy."""
    set_policy("O2")
    barrier = threading.Barrier(2, timeout=30)
    seen, errors = {}, []

    def worker(name, outer, inner, fail):
        try:
            with policy_scope(outer):
                barrier.wait()  # both threads inside their outer scope at once
                try:
                    with policy_scope(inner):
                        barrier.wait()
                        seen[name, "inner"] = (active_policy(), keras.config.dtype_policy().name)
                        if fail:
                            raise RuntimeError("boom")
                except RuntimeError:
                    pass
                seen[name, "outer"] = (active_policy(), keras.config.dtype_policy().name)
            seen[name, "after"] = (active_policy(), keras.config.dtype_policy().name)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=("a", "O1", "float32", True)),
               threading.Thread(target=worker, args=("b", "O3", "mixed_bfloat16", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen["a", "inner"] == (Policy("float32"), "float32")
    assert seen["a", "outer"] == (Policy("O1"), "mixed_float16")
    assert seen["b", "inner"] == (Policy("mixed_bfloat16"), "mixed_bfloat16")
    assert seen["b", "outer"] == (Policy("O3"), "float16")
    assert seen["a", "after"] == seen["b", "after"] == (None, "float32")  # each thread's own default
    assert active_policy() == Policy("O2") and keras.config.dtype_policy().name == "float16"
