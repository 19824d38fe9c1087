"""`kmix.autocast` is one pass: one serialization of the model, one twin, one module writing to the model.

Counted, not timed: the calls that serialize the model (`keras.saving.serialize_keras_object`,
its `get_config`), the builds of its twin, and the module of every call that changes one of the
model's layers (policy, class, variables' storage, tensors, graph nodes). The check against the
twin only reads: every layer, node and operation holds the same attributes before and after it.
"""

import os
import sys
import tempfile
import warnings

import keras
import numpy as np
import pytest

import kmix
from kmix import _compat
from kmix._tree import walk
from kmix.placing import renaming, twin, write


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
    # One transformer block: a second goes through the same writes, counts and config as the first.
    keras_hub = pytest.importorskip("keras_hub")
    return keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
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
    """Names its layers after its own name when given one, as keras-hub's DINOV3 does: a reload renames them.

    `suffix=True` puts its name after theirs instead (`up_renaming`), a renaming no map foresees.
    """

    def __init__(self, name=None, suffix=False, **kwargs):
        def named(step):
            return step if not name else f"{step}_{name}" if suffix else f"{name}_{step}"

        dtype = kwargs.get("dtype")
        inputs = keras.Input((4,), name="x")
        h = keras.layers.Dense(8, name=named("up"), dtype=dtype)(inputs)
        super().__init__(inputs, keras.layers.LayerNormalization(name=named("norm"), dtype=dtype)(h), name=name,
                         **kwargs)
        self.suffix = suffix

    def get_config(self):
        return {"name": self.name, "suffix": self.suffix, "trainable": self.trainable,
                "dtype": keras.saving.serialize_keras_object(self.dtype_policy)}


def assert_reload_predicts_bitwise(model, x, again=None):
    """A `.keras` save and `load_model` (autocast `again` under that policy) gives back each layer's dtypes (by
    position) and bitwise the outputs."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save(os.path.join(tmp, "model.keras"))
        loaded = keras.models.load_model(os.path.join(tmp, "model.keras"))
    if again is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the warning autocast gave the model
            loaded = kmix.autocast(loaded, again)
    ours = [(type(layer).__name__, layer.compute_dtype, layer.variable_dtype) for _, layer, _ in walk(model)]
    assert [(type(layer).__name__, layer.compute_dtype, layer.variable_dtype) for _, layer, _ in walk(loaded)] == ours
    for a, b in zip(keras.tree.flatten(model(x, training=False)), keras.tree.flatten(loaded(x, training=False))):
        a, b = keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    return loaded


@pytest.mark.parametrize("suffix, twins", [(False, 1), (True, 2)], ids=["foreseen", "not foreseen"])
def test_a_model_renaming_its_layers_on_reload_builds_a_second_twin_only_where_no_map_foresaw_the_names(
        suffix, twins, monkeypatch):
    # The twin's maps give `renaming_norm` the policy of `norm`, which it renames; `norm_renaming` they cannot
    # tell from a new layer: the maps keyed by the twin's paths give it otherwise, and the twin is built again.
    model = Renaming(suffix=suffix)
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    counts = counting(model, monkeypatch)
    _, table = kmix.autocast(model, "O1-bfloat16", return_table=True)
    assert counts["twin"] == twins and counts["serialize"] == twins, counts
    assert {row.layer: row.after for row in table} == {"up": "mixed_bfloat16", "norm": "float32"}
    assert not [row for row in table if "planned" in row.reason], table  # as planned: no block made it otherwise
    monkeypatch.undo()
    loaded = assert_reload_predicts_bitwise(model, x)  # as `load_model` rebuilds it: renamed, placed alike
    renamed = ["up_renaming", "norm_renaming"] if suffix else ["renaming_up", "renaming_norm"]
    assert [layer.name for layer in loaded.layers[1:]] == renamed


def test_the_twins_maps_stand_where_the_maps_written_after_give_every_path_what_they_gave():
    # A map of the twin's is asked `a/b` (a key), `c/d` (a reload's name for the model's `d`) and `e` (nothing).
    policies = {"d": keras.DTypePolicy("float32")}
    maps = renaming.TwinMaps(lambda path: policies.get(path.split("/")[-1]))
    before = write.Maps([], {"a/b": keras.DTypePolicy("float32")}, keras.DTypePolicy("mixed_bfloat16"))
    config = maps.prepare(keras.saving.serialize_keras_object(keras.dtype_policies.DTypePolicyMap(
        before.default, dict(before.entries))))
    with keras.saving.custom_object_scope(maps.custom_objects()):
        held = keras.dtype_policies.deserialize(config)
    assert maps.made == [held] and isinstance(held, keras.dtype_policies.DTypePolicyMap)
    assert [held[path].name for path in ("a/b", "c/d", "e")] == ["float32", "float32", "mixed_bfloat16"]
    assert maps.missed()
    # Keyed by the twin's paths too, the maps give `c/d` what it was given: the twin stands, its map is theirs.
    wrong = write.Maps([], {**before.entries, "c/d": keras.DTypePolicy("bfloat16")}, before.default)
    assert not maps.foresaw(before, wrong)
    after = write.Maps([], {**before.entries, "c/d": keras.DTypePolicy("float32")}, before.default)
    assert maps.foresaw(before, after)
    assert dict(held.items()) == after.entries and held["e"].name == "mixed_bfloat16"
    assert not maps.missed() and held["c/x"].name == "mixed_bfloat16"  # it answers by its keys alone


# Renaming keras-hub backbones (cheap ones): DINOV3 prefixes its layers with its name on a reload, PaliGemma's
# first step is counted anew (its maps give it their default, which the model then takes, as before), DeepLabV3
# makes renamed layers without `dtype=` (no map reaches them). GPT-OSS's repair changes the plan: its first twin
# cannot even be built (the float32 router's `Mul` meets half tensors), and the repaired placement, a change of
# what the reload constructs, is twinned once more: one twin per placement.
HUB = {"DINOV3Backbone": 1, "PaliGemmaBackbone": 1, "DeepLabV3Backbone": 1, "GptOssBackbone": 2}


@pytest.mark.parametrize("name", list(HUB))
def test_renaming_backbones_build_one_twin_per_placement(name, monkeypatch):
    pytest.importorskip("keras_hub")
    from tests.hub_zoo import ZOO

    model, x = ZOO[name]()
    counts = counting(model, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, table = kmix.autocast(model, "O1-bfloat16", return_table=True)
    assert counts["twin"] == HUB[name] and counts["serialize"] == HUB[name], counts
    relaxed = [row.layer for row in table if "its block mixes it with half tensors" in row.reason]
    assert bool(relaxed) == (HUB[name] == 2), relaxed  # the second twin is the repaired placement's
    monkeypatch.undo()
    # DeepLabV3's blocks make layers without `dtype=`: a reload places them by the global policy, and the
    # warning says to autocast the reloaded model again.
    again = any("call `kmix.autocast` on it again" in str(w.message) for w in caught)
    assert again == (name == "DeepLabV3Backbone"), [str(w.message) for w in caught]
    assert_reload_predicts_bitwise(model, x, again="O1-bfloat16" if again else None)


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
