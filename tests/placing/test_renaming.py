"""`renaming.renamed_policies` on paths a reload renames, and `renaming.TwinMaps` on one tiny twin.

The expected policies are the model's own, read off the layers by hand: a reload's name takes the policy of
the one layer it renames (after a prefix, or by Keras's counter inside a block), else None.
"""

import copy

import keras

import kmix
from kmix._tree import resolved_policy, walk
from kmix.placing import twin, write
from kmix.placing.renaming import TwinMaps, renamed_policies
from kmix.placing.rules import Kind, Plan, Row, Rules, gather


class Stack(keras.layers.Layer):
    """A block naming its norm after `prefix` (its config gives a reload `"model_"`), and two Dense Keras names.

    Its layers take its policy (a map, on a reload), as keras-hub's blocks pass theirs on.
    """

    def __init__(self, prefix="", **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization(name=prefix + "norm", dtype=self.dtype_policy)
        self.proj = keras.layers.Dense(4, name="proj", dtype=self.dtype_policy)
        self.first = keras.layers.Dense(4, dtype=self.dtype_policy)  # named by Keras's counter: dense, dense_1
        self.second = keras.layers.Dense(4, dtype=self.dtype_policy)

    def call(self, x):
        return self.second(self.first(self.proj(self.norm(x))))

    def get_config(self):
        return {**super().get_config(), "prefix": "model_"}  # a reload names its norm after the model


def stacked(counted=("float32", "float32")):
    """`dense` -> `encoder` (a `Stack`: norm float32, its counted Dense `counted`) -> `layernorm` float32."""
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4, name="dense", dtype="mixed_float16")(inputs)
    h = Stack(name="encoder", dtype="mixed_float16")(h)
    model = keras.Model(inputs, keras.layers.LayerNormalization(name="layernorm")(h), name="m")
    encoder = model.get_layer("encoder")
    for layer, dtype in [(encoder.norm, "float32"), (encoder.first, counted[0]), (encoder.second, counted[1])]:
        layer.dtype_policy = keras.DTypePolicy(dtype)  # placed, as `write.place` places them
    return model


def as_placed(model):
    """The `Plan` of `model`'s layers as they are placed now (`renamed_policies` reads the layers alone)."""
    return Plan([Row(path, layer, parent, resolved_policy(layer).name, Kind.HALF, "as placed")
                 for path, layer, parent in walk(model)], model, set())


def names(policy, paths):
    """`{path: policy name or None}`."""
    return {path: None if policy(path) is None else policy(path).name for path in paths}


def test_stack_is_placed_and_named_as_the_tests_assume():
    model = stacked(("float32", "mixed_float16"))
    assert {path: (layer.path, resolved_policy(layer).name) for path, layer, _ in walk(model)} == {
        "dense": ("dense", "mixed_float16"), "encoder": ("encoder", "mixed_float16"),
        "encoder/norm": ("encoder/norm", "float32"), "encoder/proj": ("encoder/proj", "mixed_float16"),
        "encoder/dense": ("encoder/dense", "float32"), "encoder/dense_1": ("encoder/dense_1", "mixed_float16"),
        "layernorm": ("layernorm", "float32")}


def test_a_prefix_after_the_models_name_takes_the_layers_policy():
    policy = renamed_policies(as_placed(stacked()))
    assert names(policy, ["dinov3_backbone_layernorm", "dinov3_backbone_dense", "dinov3_backbone_encoder/norm",
                          "encoder/model_norm", "dinov3_backbone_encoder/model_proj", "layernorm"]) == {
        "dinov3_backbone_layernorm": "float32",  # the docstring's example: the model's `layernorm`
        "dinov3_backbone_dense": "mixed_float16",
        "dinov3_backbone_encoder/norm": "float32",
        "encoder/model_norm": "float32",
        "dinov3_backbone_encoder/model_proj": "mixed_float16",
        "layernorm": "float32",  # its own path
    }


def test_keras_counter_running_on_inside_a_block():
    policy = renamed_policies(as_placed(stacked(("float32", "float32"))))
    assert names(policy, ["encoder/dense_7", "encoder/dense", "model_encoder/dense_12"]) == {
        "encoder/dense_7": "float32", "encoder/dense": "float32", "model_encoder/dense_12": "float32"}
    # A first step Keras counted is keyed as it is: a reload counting it anew takes the maps' default.
    assert policy("dense_3") is None


def test_a_path_no_layer_renames_is_none():
    policy = renamed_policies(as_placed(stacked()))
    assert names(policy, ["classifier", "decoder/norm", "encoder/norm_2", "encoder/proj/inner", "norm",
                          "encoder/layer_normalization_3"]) == {
        "classifier": None,
        "decoder/norm": None,  # `decoder` does not end in `_encoder`
        "encoder/norm_2": None,  # the user named it `norm`: Keras's counter does not run on it
        "encoder/proj/inner": None,  # no layer three steps down
        "norm": None,  # one step: the model's `norm` is two steps down
        "encoder/layer_normalization_3": None,  # the class of a layer the user named
    }


def test_layers_placed_otherwise_matching_one_path_give_none():
    policy = renamed_policies(as_placed(stacked(("float32", "mixed_float16"))))
    assert policy("encoder/dense_7") is None  # `dense` (float32) and `dense_1` (half) both count to it
    inputs = keras.Input((4,))
    h = keras.layers.LayerNormalization(name="norm", dtype="float32")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="pre_norm", dtype="mixed_float16")(h))
    policy = renamed_policies(as_placed(model))
    assert names(policy, ["m_pre_norm", "m_norm"]) == {"m_pre_norm": None, "m_norm": "float32"}


def test_twin_map_answers_a_path_no_key_names_by_renamed():
    float32, half = keras.DTypePolicy("float32"), keras.DTypePolicy("mixed_float16")
    maps = TwinMaps({"encoder/model_norm": float32}.get)
    held = maps.map_class(half, {"encoder/norm": float32})
    assert (held["encoder/norm"].name, maps.missed()) == ("float32", False)  # a key's answer
    assert [held["encoder/model_norm"].name, held["encoder/other"].name] == ["float32", "mixed_float16"]
    assert maps.made == [held] and maps.missed()
    assert held.answers == {
        "encoder/norm": "float32", "encoder/model_norm": "float32", "encoder/other": "mixed_float16"}
    assert held.missed == {"encoder/model_norm", "encoder/other"}
    assert held.written == {"encoder/norm": "float32"}  # its keys, untouched by the answers


def test_twin_maps_prepare_a_config_to_build_their_maps():
    maps = TwinMaps(lambda path: None)
    stored = keras.saving.serialize_keras_object(keras.dtype_policies.DTypePolicyMap(
        keras.DTypePolicy("mixed_float16"), {"encoder/norm": keras.DTypePolicy("float32")}))
    config = {"layers": [{"config": {"dtype": copy.deepcopy(stored)}}, {"config": {"dtype": "float32"}}]}
    assert maps.prepare(config) is config
    prepared = config["layers"][0]["config"]["dtype"]
    assert prepared == {**stored, "registered_name": "kmix_twin>DTypePolicyMap"}
    assert config["layers"][1] == {"config": {"dtype": "float32"}}
    with keras.saving.custom_object_scope(maps.custom_objects()):
        built = keras.saving.deserialize_keras_object(prepared)
    assert type(built) is maps.map_class and maps.made == [built]
    assert (built["encoder/norm"].name, built.default_policy.name) == ("float32", "mixed_float16")
    assert TwinMaps(lambda path: None).map_class is not maps.map_class  # a class per twin


def test_twin_maps_foresee_a_reloads_new_name():
    model = stacked()
    rules = Rules(kmix.Policy("O1"), ["encoder/norm"])
    plan = rules.plan(model, gather(model, rules))
    write.place(plan)
    encoder = model.get_layer("encoder")
    assert [resolved_policy(layer).name for layer in (encoder, encoder.norm, encoder.proj)] == [
        "mixed_float16", "float32", "mixed_float16"]
    before = write.write_maps(plan)  # keyed by the model's paths: `encoder/norm`
    assert before.holders == [encoder] and "encoder/model_norm" not in before.entries
    maps = TwinMaps(renamed_policies(plan))
    built = twin.build(model, [row.layer for row in plan], maps)
    reloaded = built.model.get_layer("encoder")
    assert built.error is None and reloaded.norm.path == "encoder/model_norm"
    assert reloaded.norm.compute_dtype == "float32"  # no key names it: the map foresaw the new name
    assert twin.build(model).model.get_layer("encoder").norm.compute_dtype == "float16"  # without: the default
    assert maps.missed()
    assert not maps.foresaw(before, before)  # the model's keys alone give `encoder/model_norm` the default
    after = write.write_maps(plan, built.model, before.holders)  # keyed by the twin's paths too
    assert after.entries["encoder/model_norm"].name == "float32"
    assert maps.foresaw(before, after)
    for held in maps.made:  # they became the maps written, answering by their keys alone
        assert held.renamed is None and held.written["encoder/model_norm"] == "float32"
        assert held["encoder/model_norm"].name == "float32" and held["encoder/new_norm"].name == "mixed_float16"
