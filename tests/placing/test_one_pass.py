"""`kmix.autocast` is one pass: one serialization of the model, one twin, one module writing to the model.

Counted, not timed: the calls that serialize the model (`keras.saving.serialize_keras_object`,
its `get_config`), the builds of its twin, and the module of every call that changes one of the
model's layers (policy, class, variables' storage, tensors, graph nodes). The check against the
twin only reads: every layer, node and operation holds the same attributes before and after it.
"""

import os
import sys
import tempfile

import keras
import numpy as np
import pytest

import kmix
from kmix import _compat
from kmix._tree import walk
from kmix.placing import twin, write


def sequential():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.LayerNormalization(), keras.layers.Dense(3, activation="softmax")])


def functional():
    inputs = keras.Input((5, 8), name="x")
    h = keras.layers.Dense(8, name="up")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.MultiHeadAttention(2, 4, name="attention")(h, h)
    h = keras.layers.Softmax(name="softmax")(keras.layers.Dense(4, name="down")(h))
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def gpt2():
    keras_hub = pytest.importorskip("keras_hub")
    return keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
                                         intermediate_dim=32, max_sequence_length=16)


MODELS = {"sequential": sequential, "functional": functional, "gpt2": gpt2}


def counting(model, monkeypatch):
    """`{"serialize", "get_config", "twin", "deserialize"}` counts, kept while `model` is placed."""
    counts = {"serialize": 0, "get_config": 0, "twin": 0, "deserialize": 0}
    serialize, deserialize = keras.saving.serialize_keras_object, keras.saving.deserialize_keras_object
    build, get_config = twin.build, type(model).get_config

    def counting_serialize(obj, *args, **kwargs):
        counts["serialize"] += obj is model
        return serialize(obj, *args, **kwargs)

    def counting_get_config(self):
        counts["get_config"] += self is model
        return get_config(self)

    def counting_deserialize(config, *args, **kwargs):
        counts["deserialize"] += isinstance(config, dict) and config.get("class_name") == type(model).__name__
        return deserialize(config, *args, **kwargs)

    def counting_build(*args, **kwargs):
        counts["twin"] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(keras.saving, "serialize_keras_object", counting_serialize)
    monkeypatch.setattr(keras.saving, "deserialize_keras_object", counting_deserialize)
    monkeypatch.setattr(type(model), "get_config", counting_get_config)
    monkeypatch.setattr(twin, "build", counting_build)
    return counts


@pytest.mark.parametrize("policy", ["O1", "O1-bfloat16", "O2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_autocast_serializes_once_and_builds_one_twin(name, policy, monkeypatch):
    model = MODELS[name]()
    counts = counting(model, monkeypatch)
    assert kmix.autocast(model, policy) is model
    assert counts == {"serialize": 1, "get_config": 1, "twin": 1, "deserialize": 1}, counts


@keras.saving.register_keras_serializable(package="kmix_tests")
class Renaming(keras.Model):
    """Names its layers after its own name when given one, as keras-hub's DINOV3 does: a reload renames them."""

    def __init__(self, name=None, **kwargs):
        prefix, dtype = f"{name}_" if name else "", kwargs.get("dtype")
        inputs = keras.Input((4,), name="x")
        h = keras.layers.Dense(8, name=prefix + "up", dtype=dtype)(inputs)
        super().__init__(inputs, keras.layers.LayerNormalization(name=prefix + "norm", dtype=dtype)(h), name=name,
                         **kwargs)

    def get_config(self):
        return {"name": self.name, "trainable": self.trainable,
                "dtype": keras.saving.serialize_keras_object(self.dtype_policy)}


def test_a_model_renaming_its_layers_on_reload_builds_a_second_twin_keyed_by_the_first(monkeypatch):
    model = Renaming()
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    counts = counting(model, monkeypatch)
    _, table = kmix.autocast(model, "O1-bfloat16", return_table=True)
    assert counts["twin"] == 2 and counts["serialize"] == 2, counts
    assert {row.layer: row.after for row in table} == {"up": "mixed_bfloat16", "norm": "float32"}
    monkeypatch.undo()
    with tempfile.TemporaryDirectory() as tmp:  # as `load_model` rebuilds it: renamed, placed alike, bit for bit
        model.save(os.path.join(tmp, "renaming.keras"))
        loaded = keras.models.load_model(os.path.join(tmp, "renaming.keras"))
    assert [layer.name for layer in loaded.layers[1:]] == ["renaming_up", "renaming_norm"]
    assert [layer.compute_dtype for layer in loaded.layers[1:]] == ["bfloat16", "float32"]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(model(x)))


@pytest.mark.parametrize("name", list(MODELS))
def test_only_the_writer_changes_the_model(name, monkeypatch):
    model = MODELS[name]()
    ours = {id(model)} | {id(layer) for _, layer, _ in walk(model)}
    writers = set()

    def caller():  # the first frame outside Keras, keras-hub and TensorFlow (their `__setattr__`s)
        frame = sys._getframe(2)
        while frame.f_globals["__name__"].split(".")[0] in ("keras", "keras_hub", "tensorflow"):
            frame = frame.f_back
        return frame.f_globals["__name__"]

    def recording(function):
        def record(target, *args, **kwargs):
            writers.add(caller())
            return function(target, *args, **kwargs)
        return record

    for name_ in ("recast_variable", "set_class", "set_layer_tensor", "set_node_arguments",
                  "set_operation_setting", "replace_dtype_policy"):
        monkeypatch.setattr(_compat, name_, recording(getattr(_compat, name_)))
    policy_property = keras.layers.Layer.dtype_policy

    def set_policy(layer, value):
        if id(layer) in ours:
            writers.add(caller())
        policy_property.fset(layer, value)

    monkeypatch.setattr(keras.layers.Layer, "dtype_policy", property(policy_property.fget, set_policy))
    kmix.autocast(model, "O2")
    assert writers == {"kmix.placing.write"}, writers


@keras.saving.register_keras_serializable(package="kmix_tests")
class Scaled(keras.Model):
    """`x * cast(sqrt(d), x.dtype)` baked into the graph at build, as keras-hub's Gemma does."""

    def __init__(self, dim=4, **kwargs):
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(10, dim, name="embedding", dtype=kwargs.get("dtype"))(tokens)
        x = x * keras.ops.cast(keras.ops.sqrt(float(dim)), x.dtype)
        super().__init__(tokens, keras.layers.Dense(dim, name="proj", dtype=kwargs.get("dtype"))(x), **kwargs)
        self.dim = dim

    def get_config(self):
        return {"dim": self.dim, "name": self.name, "trainable": self.trainable,
                "dtype": keras.saving.serialize_keras_object(self.dtype_policy)}


@pytest.mark.parametrize("make", [functional, Scaled], ids=["functional", "graph constant"])
def test_the_check_reads_only(make, monkeypatch):
    model = make()
    check, edits = twin.check, []
    settle = write.settle

    def recording_settle(model, found):
        edits.append(found)
        return settle(model, found)

    def reading_check(placed, *args, **kwargs):
        objects = [placed] + [layer for _, layer, _ in walk(placed)]
        objects += [part for layer in objects if _compat.is_functional(layer)
                    for node in _compat.graph_nodes(layer) for part in (node, _compat.node_call(node)[0])]
        states = [(obj, _compat.object_state(obj)) for obj in objects]
        verdict = check(placed, *args, **kwargs)
        assert not [obj for obj, state in states if _compat.restore_object_state(obj, state)]
        return verdict

    monkeypatch.setattr(write, "settle", recording_settle)
    monkeypatch.setattr(twin, "check", reading_check)
    kmix.autocast(model, "O1-bfloat16")
    # The graph constant was taken from the twin by the writer, before the check: a reload predicts the same.
    assert (len(edits[0].nodes) > 0) == (make is Scaled)
    x = np.ones((2, 3), "int32") if make is Scaled else np.ones((2, 5, 8), "float32")
    from tests.testing import assert_placement_survives_reload

    assert_placement_survives_reload(model, x)


@pytest.mark.parametrize("make", [sequential, functional, Scaled, gpt2], ids=["sequential", "functional",
                                                                            "functional subclass", "gpt2"])
def test_which_configs_list_their_layers_is_read_without_serializing(make):
    model = make()
    assert _compat.lists_layers(model) == ("layers" in model.get_config())  # as Keras's own config says
