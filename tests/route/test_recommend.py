"""`kmix.recommend(model, ...)` on small models, which it must leave as they were (the decision itself:
test_recommendation.py)."""

import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf

import kmix
from kmix import _compat, device
from kmix.route import trials
from kmix.route.recommendation import decide, decide_routes
from tests.testing import created_variables
from tests.route.fakes import CPU_PLAIN, FAKE_PROBE, STEADY, route_table


def _small_model():
    keras_ = __import__("keras")
    inputs = keras_.Input((16,))
    h = keras_.layers.Dense(32, activation="gelu")(inputs)
    h = keras_.layers.LayerNormalization()(h)
    model = keras_.Model(inputs, keras_.layers.Dense(4)(h))
    model.compile(optimizer=keras_.optimizers.AdamW(1e-3),
                  loss=keras_.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    return model, x, x[:, :4].argmax(axis=1)


def _state(model):
    """What recommend must not change: weights, each layer's policy and class, the compiled state."""
    return ([v.numpy().copy() for v in model.weights],
            [(layer.name, type(layer), layer.dtype_policy.name) for layer in _all_layers(model)],
            model.optimizer, int(model.optimizer.iterations.numpy()), len(model.optimizer.variables),
            model.loss, model.train_function, model.jit_compile)


def _all_layers(layer):
    for sub in _compat.sublayers(layer):
        yield sub
        yield from _all_layers(sub)


def _assert_same_state(before, after):
    (w0, layers0, *rest0), (w1, layers1, *rest1) = before, after
    assert len(w0) == len(w1) and all(np.array_equal(a, b) for a, b in zip(w0, w1))
    assert layers0 == layers1
    assert all(a is b or a == b for a, b in zip(rest0, rest1)), (rest0, rest1)


def test_recommend_on_a_model_times_its_routes_and_leaves_the_model_as_it_was(caplog):
    import keras

    model, x, y = _small_model()
    before, policy = _state(model), keras.config.dtype_policy().name
    with caplog.at_level("WARNING"):
        rec = kmix.recommend(model, x, y, batch_size=16, dtypes=("bfloat16",), budget_s=12.0, probe=FAKE_PROBE,
                             verbose=False)
    _assert_same_state(before, _state(model))
    assert keras.config.dtype_policy().name == policy
    assert "retracing" not in caplog.text
    table = rec.table
    routes = [("float32", False), ("float32", True), ("O1-bfloat16", False), ("O1-bfloat16", True)]
    timed = [(r.policy, r.jit_compile) for r in table.routes]
    # Each route is timed or named as left out for the budget; the table keeps their order; float32's
    # reference (Keras's default compilation, on this probe) is built first.
    assert sorted(timed + [_route(label) for label, _ in table.over_budget]) == sorted(routes)
    assert timed == [r for r in routes if r in timed] and table.order[0] == ("float32", False) in timed
    if table.chosen is not None:
        chosen = table.routes[table.chosen]
        assert (chosen.policy, chosen.jit_compile) == (rec.policy, rec.jit_compile)
    else:  # a loaded machine: the budget timed float32 only, and the probe's route is not in the table
        assert all(r.policy == "float32" for r in table.routes) and "not measured on your model" in str(rec)
    assert table.routes[table.reference].policy == "float32"
    # Routes compared get the documented minimum of rounds, or the reasons say how many they got (the rounds
    # stop at 1.2x budget_s); a route alone (the budget built no other) one.
    fewest = min(len(r.seconds) for r in table.routes)
    assert fewest >= trials.MIN_ROUNDS or len(table.routes) == 1 == fewest or "fewer than the 5" in str(rec)
    assert all(s > 0 for r in table.routes for s in r.seconds) and table.batch == "a batch of 16 rows"
    # The decision is the pure one, on the table shown.
    again = decide_routes(dataclasses.replace(table, chosen=None), rec.probe, device.gpus(), device.cpu_features(),
                          device.onednn_enabled())
    assert (again.policy, again.jit_compile) == (rec.policy, rec.jit_compile)
    text = str(rec)
    assert "ms/step" in text and "median of interleaved rounds" in text
    # The route trains as the README builds it.
    fast = kmix.autocast(model, rec.policy, copy=True)
    with kmix.policy_scope(rec.policy):
        fast.compile(optimizer=kmix.wrap("adam"), loss=model.loss, jit_compile=rec.jit_compile)
    assert np.isfinite(fast.fit(x, y, batch_size=16, epochs=1, verbose=0).history["loss"][-1])


def _route(label):
    policy, compiled = label.split(", ")
    return policy, compiled == "XLA"


def _bn_model():
    import keras

    inputs = keras.Input((8,))
    h = keras.layers.Dense(16)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.2)(keras.layers.Activation("softmax")(h))
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.integers(0, 3, (32,))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model, x, y


def test_recommend_creates_one_optimizer_state_and_puts_back_what_a_step_moves():
    """Counted, not timed: the variables made during recommend are one optimizer's state (SGD with momentum:
    one slot per trainable variable) and the loss-scale optimizers' scalars, never a copy of the weights;
    the batch-norm statistics and the dropout seed a training step moves are put back bit for bit."""
    model, x, y = _bn_model()
    before = _state(model)
    reference = model.predict(x, verbose=0)
    with created_variables() as created:  # autocast's weightless twins included: they create none
        rec = kmix.recommend(model, x, y, batch_size=8, dtypes=("bfloat16",), budget_s=8.0, probe=FAKE_PROBE,
                             verbose=False)
    _assert_same_state(before, _state(model))
    np.testing.assert_array_equal(model.predict(x, verbose=0), reference)
    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    large = [v for v in created if int(np.prod(v.shape)) > 16]
    made = sum(int(np.prod(v.shape)) for v in large)
    assert made <= weights, (made, weights, [v.name for v in large])  # one momentum slot per variable
    assert all("momentum" in v.name for v in large if int(np.prod(v.shape)) in (16 * 8, 16 * 3)), large
    assert len(rec.table.routes) >= 1


def test_recommend_refuses_bad_arguments_at_the_call_before_timing(monkeypatch):
    from kmix.route import trials as trials_module

    model, x, y = _small_model()
    monkeypatch.setattr(trials_module, "time_routes", lambda *a, **k: pytest.fail("timed a refused call"))
    for budget in (-1, 0, float("nan"), "30", True):
        with pytest.raises(ValueError, match=r"`budget_s` must be a positive number.*Received: budget_s="):
            kmix.recommend(model, x, y, dtypes=["float32"], budget_s=budget, verbose=False)
    with pytest.raises(ValueError, match=r"`x` does not fit model .* takes input shape \(None, 16\)\. "
                                         r"Received: x with shape \(32, 12\)"):
        kmix.recommend(model, np.zeros((64, 12), "float32"), y, dtypes=["float32"], verbose=False)
    with pytest.raises(ValueError, match=r"`sample` does not fit model"):
        kmix.recommend(model, sample=(np.zeros((8, 3), "float32"), y[:8]), dtypes=["float32"], verbose=False)
    # Issue 48 item 7: no rows, targets of another length, an optimizer that is none.
    with pytest.raises(ValueError, match=r"`x` holds 0 rows.*Received: x with shape \(0, 16\)"):
        kmix.recommend(model, x[:0], y[:0], verbose=False)
    with pytest.raises(ValueError, match=r"`y` must have one row per row of `x` \(64\)\. Received: y with shape "
                                         r"\(50,\), x with shape \(64, 16\)"):
        kmix.recommend(model, x, y[:50], verbose=False)
    with pytest.raises(ValueError, match=r"`sample's y` must have one row per row of `sample's x` \(8\)"):
        kmix.recommend(model, sample=(x[:8], y[:5]), verbose=False)
    ragged = tf.data.Dataset.from_tensors((x[:8], y[:6]))
    with pytest.raises(ValueError, match=r"`x's first batch's y` must have one row per row"):
        kmix.recommend(model, ragged, verbose=False)
    for call in (lambda: kmix.recommend(optimizer=42, verbose=False),
                 lambda: kmix.recommend(model, x, y, optimizer=42, verbose=False)):
        with pytest.raises(TypeError, match=r"`optimizer` must be a Keras optimizer.*Received: optimizer=42 of type"):
            call()
    with pytest.raises(ValueError, match=r"`optimizer` names no Keras optimizer.*Received: optimizer='adamm'"):
        kmix.recommend(model, x, y, optimizer="adamm", verbose=False)


def test_non_finite_data_gets_a_note():
    model, x, y = _small_model()
    x = x.copy()
    x[3, 2], x[5, 0] = np.nan, np.inf
    rec = kmix.recommend(model, x, y, batch_size=16, dtypes=["float32"], budget_s=0.001, probe=FAKE_PROBE,
                         verbose=False)  # nothing is built: the probe decides
    notes = [r for r in rec.reasons if "NaN or inf" in r]
    assert len(notes) == 1 and notes[0].startswith("`x` holds 2 NaN or inf value(s)")
    assert not any("`y`" in r for r in rec.reasons)


def test_recommend_on_a_keras_hub_classifier_built_from_arguments(monkeypatch):
    """A model named in no issue, as a user would pass it: a RoFormer V2 text classifier, a dataset."""
    keras_hub = pytest.importorskip("keras_hub")
    import keras
    from kmix.route import trials as trials_module

    # Routes are built: neither the forward pass nor the probe's pace (2.5 s of budget_s=3 for this model's
    # 15 variables, which a loaded machine's checks before building overrun) keeps the first one out.
    monkeypatch.setattr(trials_module, "build_estimate", lambda model, x: (float("-inf"), 0.0))
    monkeypatch.setattr(trials_module, "first_build", lambda *args, **kwargs: 0.0)

    backbone = keras_hub.models.RoformerV2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                                   intermediate_dim=32, head_size=8)
    model = keras_hub.models.RoformerV2TextClassifier(backbone=backbone, num_classes=3, preprocessor=None)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, 64, (8, 12)).astype("int32"), "segment_ids": np.zeros((8, 12), "int32")}
    y = rng.integers(0, 3, (8,))
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    model.fit(data, epochs=1, verbose=0, shuffle=False)
    before = _state(model)
    rec = kmix.recommend(model, data, dtypes=["float32", "bfloat16"], budget_s=3.0, probe=FAKE_PROBE, verbose=False)
    _assert_same_state(before, _state(model))
    assert rec.table.batch == "the dataset's first batch"
    assert len(rec.table.routes) + len(rec.table.over_budget) == 4 and rec.table.routes[0].policy == "float32"
    assert rec.policy in ("float32", "O1-bfloat16")
    kmix.Policy(rec.policy)  # a spec kmix accepts as it is


def test_recommend_says_what_it_needs():
    import keras

    model, x, y = _small_model()
    bare = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="loss=None"):
        kmix.recommend(bare, x, y, dtypes=["float32"], verbose=False)
    with pytest.raises(ValueError, match=r"x=ndarray, y=NoneType"):
        kmix.recommend(model, x, dtypes=["float32"], verbose=False)
    with pytest.raises(TypeError, match="`sample` must be a batch"):
        kmix.recommend(model, sample=x, dtypes=["float32"], verbose=False)
    with pytest.raises(ValueError, match="not both"):
        kmix.recommend(model, x, y, sample=(x, y), dtypes=["float32"], verbose=False)
    with pytest.raises(ValueError, match="`dtypes` must name"):
        kmix.recommend(model, x, y, dtypes=["int8"], verbose=False)
    with pytest.raises(ValueError, match="batch_size=0"):
        kmix.recommend(model, x, y, batch_size=0, dtypes=["float32"], verbose=False)
    # Without data, the model only sizes the probe, and the reasons say how to time the model instead.
    rec = kmix.recommend(model, probe=FAKE_PROBE, verbose=False)
    assert "pass x=, y=" in str(rec) and rec.table is None


def test_the_reasons_name_the_float32_route_the_table_marks():
    """#41 item 5: with a GPU (Keras's default: XLA) and float32's tf.function 2% faster, within the noise floor,
    the reference is float32 under XLA: the reasons name it as the table marks it, and say why it is not the
    faster row."""
    gpu = [{"name": "A100", "compute_capability": (8, 0)}]
    table = route_table(float32_tf=[t / 1.02 for t in STEADY], float32_xla=STEADY, O1_bfloat16_tf=[2.0] * 5,
                   O1_bfloat16_xla=[t * 1.1 for t in STEADY])
    rec = decide_routes(table, None, gpu, CPU_PLAIN)
    assert rec.policy == "float32" and rec.table.routes[rec.table.reference].label == "float32, XLA"
    marked = [line for line in str(rec.table).splitlines() if "<- float32 reference" in line]
    assert len(marked) == 1 and "XLA" in marked[0]
    reason = next(r for r in rec.reasons if "reference route" in r)
    assert "float32's reference route (float32, XLA" in reason and "Keras's default compilation, within 3%" in reason
    # Where the other compilation is faster beyond the floor, it is the reference, and the reasons say by how much.
    table = route_table(float32_tf=[t / 1.2 for t in STEADY], float32_xla=STEADY, O1_bfloat16_tf=[2.0] * 5)
    rec = decide_routes(table, None, gpu, CPU_PLAIN)
    assert rec.table.routes[rec.table.reference].label == "float32, tf.function"
    assert "float32's reference route (float32, tf.function" in str(rec) and "1.20x the other compilation" in str(rec)


def test_still_at_zero_tells_the_optimizers_that_move_nothing_at_learning_rate_0():
    import keras

    from kmix.route.data import still_at_zero

    class Stubborn(keras.optimizers.SGD):  # an optimizer of a user's that ignores the learning rate
        def update_step(self, gradient, variable, learning_rate):
            variable.assign_sub(0.01 * gradient)

    for optimizer in ("sgd", keras.optimizers.SGD(0.1, momentum=0.9), keras.optimizers.AdamW(weight_decay=0.1),
                      keras.optimizers.Lion(), keras.optimizers.Adafactor()):
        assert still_at_zero(optimizer), optimizer
    for optimizer in (keras.optimizers.Ftrl(), Stubborn(0.1)):  # FTRL divides by the learning rate
        assert not still_at_zero(optimizer), optimizer


def test_preserved_keeps_values_only_of_what_it_is_told_and_is_loud_on_the_rest(tmp_path):
    from kmix._preserved import Preserved

    model, x, _ = _bn_model()
    trainable = model.trainable_variables[0]
    statistics = [v for v in model.non_trainable_variables if "moving" in v.path]
    before = [v.numpy().copy() for v in (trainable, *statistics)]
    with Preserved(model, saved="non-trainable") as kept:
        # No trainable weight copied: the statistics, seed states and compiled metrics' variables.
        assert len(os.listdir(kept._dir)) == len(model.non_trainable_variables) + len(model.metrics_variables)
        for v in statistics:
            v.assign(v + 1.0)
    for v, value in zip(statistics, before[1:]):
        np.testing.assert_array_equal(v.numpy(), value)

    with pytest.raises(RuntimeError, match=f"changed where kmix kept no copy.*{trainable.path}"):
        with Preserved(model, saved="non-trainable"):
            trainable.assign(trainable + 1.0)
    with pytest.raises(ValueError, match="`saved` must be one of"):
        Preserved(model, saved="trainable")


def test_recommend_with_an_optimizer_that_moves_at_learning_rate_0_keeps_a_copy_and_puts_it_back():
    import keras

    model, x, y = _bn_model()
    model.compile(optimizer=keras.optimizers.Ftrl(0.1), loss=model.loss)
    before = _state(model)
    kmix.recommend(model, x, y, batch_size=8, dtypes=("bfloat16",), budget_s=3.0, probe=FAKE_PROBE, verbose=False)
    _assert_same_state(before, _state(model))


def test_a_probe_with_no_time_for_xla_leaves_it_out_and_says_so():
    """#49 item 2: the probe keeps to `limit_s` by leaving XLA's compilations out (they cost several times the
    tf.function traces); what it measured decides, its table and the reasons say which were not probed, and a
    later call without a limit measures them (the probe is measured again, not the limited one returned)."""
    shape = (64, 16, 48)  # a shape no other test probes: the cache holds nothing for it yet
    limited = device.probe(shape, budget=0.02, limit_s=0.0)
    assert limited.compilations == (False,) and set(limited.gflops) == {(d, False) for d in device.DTYPES}
    assert limited.rate("float32", True) == 0.0 and limited.best("float32")[1] is False
    assert "XLA not probed" in str(limited)
    rec = decide(limited, [], CPU_PLAIN)
    assert rec.jit_compile is False and str(rec).count("/ not probed") == 3
    assert "timed as tf.function only" in str(rec)
    assert device.probe(shape, budget=0.02, limit_s=0.0) is limited  # cached within the limit
    full = device.probe(shape, budget=0.02)
    assert full.compilations == (False, True) and set(full.gflops) == {(d, j) for d in device.DTYPES
                                                                       for j in (False, True)}
    assert device.probe(shape, budget=0.02, limit_s=0.0) is full  # the fuller probe answers from then on
