"""Unit tests of the pure helpers of `kmix.placing.write`: the keys and policies of the maps autocast writes
(`_entries`, `_path_pattern`, `_default`), `is_constant`, and `fixed_dtype_variables` on a Dense with LoRA;
each against a hand-written expectation or Keras's own `DTypePolicyMap` lookup."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from kmix._tree import resolved_policy, walk
from kmix.placing.write import _default, _entries, _path_pattern, fixed_dtype_variables, is_constant


class Block(keras.layers.Layer):
    """An auto-named Dense and a named one: what a keras-hub block holds."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.auto = keras.layers.Dense(3)
        self.named = keras.layers.Dense(3, name="named")

    def call(self, x):
        return self.named(self.auto(x))


class Stack(keras.Model):
    """Two auto-named blocks (`block`, `block_1`) and a named `head`: paths `stack/block_1/dense_1` and the like."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [Block(), Block()]
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(scope="module")
def stack():
    """The stack, its layers placed by hand: the auto Denses bfloat16, the named ones float32 and float16.
    Built once: the tests only read it."""
    model = Stack(name="stack")
    model(np.zeros((1, 3), "float32"))
    first, second = model.blocks
    first.auto.dtype_policy = second.auto.dtype_policy = "mixed_bfloat16"
    second.named.dtype_policy = "mixed_float16"
    return model


BLOCK = r"stack/block(?:_\d+)?"
DENSE = r"stack/block(?:_\d+)?/dense(?:_\d+)?"


def test_the_stack_has_the_paths_the_patterns_are_written_for(stack):
    model = stack
    assert [layer.path for _, layer, _ in walk(model)] == [
        "stack/block", "stack/block/dense", "stack/block/named",
        "stack/block_1", "stack/block_1/dense_1", "stack/block_1/named", "stack/head"]


@pytest.mark.parametrize("path, expected", [
    ("stack/block", BLOCK),
    ("stack/block_1/dense_1", DENSE),
    ("stack/block/dense", DENSE),
    ("stack/block_1/named", r"stack/block(?:_\d+)?/named"),
    ("stack/head", None),  # no step auto-named
    ("stack", None),
])
def test_path_pattern_against_hand_written_patterns(stack, path, expected):
    model = stack
    by_path = {layer.path: layer for _, layer, _ in walk(model)}
    assert _path_pattern(path, by_path) == expected


def test_a_path_pattern_matches_any_count_of_the_same_classes_and_nothing_else(stack):
    model = stack
    by_path = {layer.path: layer for _, layer, _ in walk(model)}
    pattern = _path_pattern("stack/block_1/dense_1", by_path)
    for path in ("stack/block/dense", "stack/block_7/dense_12", "stack/block_1/dense_1"):
        assert re.fullmatch(pattern, path), path
    for path in ("stack/block_1/dense_1/kernel", "stack/block_x/dense", "stack/blocks/dense", "other/block/dense",
                 "stack/block/named", "stack/block_1/dense1"):
        assert not re.fullmatch(pattern, path), path


def test_path_pattern_keeps_the_first_step_a_steps_unknown_layer_and_special_characters_literal():
    """The first step is the root's (a model's name, or a graph model's layer whose name its config keeps);
    a step missing from `by_path` is taken as named; the named steps are escaped."""
    dense = keras.layers.Dense(1)
    assert dense.name == "dense"
    assert _path_pattern("dense", {"dense": dense}) is None
    assert _path_pattern("x/dense", {"x/dense": None}) is None  # no layer known there
    named = keras.layers.Dense(1, name="m.v2+")
    pattern = _path_pattern("m.v2+/dense", {"m.v2+": named, "m.v2+/dense": dense})
    assert pattern == re.escape("m.v2+") + r"/dense(?:_\d+)?"
    assert re.fullmatch(pattern, "m.v2+/dense_3") and not re.fullmatch(pattern, "mXv2+/dense_3")


def test_entries_key_exact_paths_and_patterns_with_one_policy(stack):
    """Expected by hand: the named root and head by path; the blocks and their auto Denses by pattern (each
    covering layers of one policy); the two `named` Denses (float32 and float16) under no key."""
    model = stack
    rows = list(walk(model))
    entries = _entries([(model, model)] + [(layer, layer) for _, layer, _ in rows])
    assert {key: policy.name for key, policy in entries.items()} == {
        "stack": "float32",
        BLOCK: "float32",
        DENSE: "mixed_bfloat16",
        "stack/head": "float32",
    }
    assert entries["stack"] is resolved_policy(model) and entries["stack/head"] is resolved_policy(model.head)


def test_entries_read_by_keras_give_each_layer_its_policy_under_the_counts_of_a_reload(stack):
    """A `DTypePolicyMap` of the entries (as `write_maps` writes it), looked up by Keras at paths a reload's
    counters could give: each finds the policy the layer it stands for was placed under, or the default."""
    model = stack
    rows = list(walk(model))
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="mixed_float16")
    for key, policy in _entries([(layer, layer) for _, layer, _ in rows]).items():
        policy_map[key] = policy
    expected = {"stack/block_4": "float32", "stack/block_4/dense_8": "mixed_bfloat16",
                "stack/block_5/dense_9": "mixed_bfloat16", "stack/head": "float32",
                "stack/block_4/named": "mixed_float16"}  # not covered by one policy: the default
    assert {path: policy_map[path].name for path in expected} == expected


def test_entries_take_the_key_from_the_named_layer_and_the_policy_from_the_placed_one():
    """`(named, layer)`: a twin's layer gives the path, ours the policy; the first pair of a path wins; a layer
    without a path gives no key."""
    placed = keras.layers.Dense(1, name="placed", dtype="mixed_bfloat16")
    placed_too = keras.layers.Dense(1, name="placed_too", dtype="mixed_float16")
    x = keras.Input((2,))
    twin = keras.Model(x, keras.layers.Dense(1, name="twin_head")(x), name="twin")
    named = twin.get_layer("twin_head")
    unbuilt = keras.layers.Dense(1)
    assert named.path == "twin_head" and unbuilt.path is None
    entries = _entries([(named, placed), (named, placed_too), (unbuilt, placed_too)])
    assert list(entries) == ["twin_head"] and entries["twin_head"] is placed.dtype_policy
    assert _entries([]) == {}


def test_default_is_the_policy_most_layers_compute_under(stack):
    model = stack
    rows = list(walk(model))  # float32: 2 blocks, 1 named, head; bfloat16: 2; float16: 1
    assert _default(rows).name == "float32"
    halves = [row for row in rows if resolved_policy(row[1]).name != "float32"]
    assert _default(halves).name == "mixed_bfloat16"  # 2 against 1
    default = _default([])
    assert isinstance(default, keras.DTypePolicy) and default.name == "float32"


@pytest.mark.parametrize("value, expected", [
    (tf.constant([1.0, 2.0]), True),
    (tf.constant([1.0], tf.bfloat16), True),
    (tf.constant(0.5, tf.float16), True),
    (tf.constant([1, 2]), False),            # not a float
    (tf.constant([True]), False),
    (np.ones(2, "float32"), False),          # not a tensor
    (1.5, False),
    (None, False),
    (tf.sparse.from_dense(tf.constant([[1.0, 0.0]])), True),
    (tf.ragged.constant([[1.0], [2.0, 3.0]]), True),
    (keras.KerasTensor((2,), "float32"), False),  # symbolic: no value to recast
])
def test_is_constant_is_a_float_tensor(value, expected):
    assert is_constant(value) is expected


def test_is_constant_leaves_variables_out():
    assert not is_constant(keras.Variable(np.ones(2, "float32")))
    assert not is_constant(tf.Variable(np.ones(2, "float32")))
    assert is_constant(tf.convert_to_tensor(keras.Variable(np.ones(2, "float32"))))


def test_is_constant_agrees_with_tf_is_tensor_on_every_attribute_of_a_models_layers():
    """The isinstance test against `tf.is_tensor` (what it replaced, 20x slower): the same answer on each value."""
    inputs = keras.Input((4, 8))
    h = keras.layers.MultiHeadAttention(2, 4)(inputs, inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.LayerNormalization()(h)))
    model.layers[1].scale_constant = tf.constant(0.5)  # a constant computed when built, as some layers hold
    values = [value for _, layer, _ in walk(model) for value in vars(layer).values()]
    expected = [tf.is_tensor(v) and not isinstance(v, (keras.Variable, tf.Variable)) and v.dtype.is_floating
                for v in values]
    assert sum(expected) == 1 and [is_constant(v) for v in values] == expected


def _lora_dense():
    dense = keras.layers.Dense(3, name="d")
    dense.build((None, 4))
    dense.enable_lora(2)
    return dense


def _weights_state(layer):
    return [(id(w), w.path, w.dtype, w.numpy().copy()) for w in layer.weights]


def test_fixed_dtype_variables_are_loras_float32_ones_under_a_half_variable_policy():
    """Keras makes LoRA's A and B float32 whatever the policy (expected by hand); under a float32 variable dtype
    nothing differs. The layer itself is left as it was (its weights, their dtypes and values)."""
    dense = _lora_dense()
    before = _weights_state(dense)
    lora = {id(dense.lora_kernel_a), id(dense.lora_kernel_b)}
    assert fixed_dtype_variables(dense, keras.DTypePolicy("bfloat16")) == lora
    assert fixed_dtype_variables(dense, keras.DTypePolicy("float16")) == lora
    assert fixed_dtype_variables(dense, keras.DTypePolicy("float32")) == set()
    assert fixed_dtype_variables(dense, keras.DTypePolicy("mixed_bfloat16")) == set()  # float32 variables
    after = _weights_state(dense)
    assert [row[:3] for row in after] == [row[:3] for row in before]
    for (*_, got), (*_, want) in zip(after, before):
        np.testing.assert_array_equal(got, want)


def test_fixed_dtype_variables_of_a_plain_dense_are_none():
    dense = keras.layers.Dense(3)
    dense.build((None, 4))
    assert fixed_dtype_variables(dense, keras.DTypePolicy("bfloat16")) == set()


class _NoRebuild(keras.layers.Layer):
    """A layer whose config misses a constructor argument: `from_config` fails, as some users' layers do."""

    def __init__(self, required, **kwargs):
        super().__init__(**kwargs)
        self.required = required

    def build(self, input_shape):
        self.kernel = self.add_weight(name="kernel", shape=(input_shape[-1], 2))
        self.lora_scale = self.add_weight(name="lora_scale", shape=(2,), dtype="bfloat16")
        self.lora_gate = self.add_weight(name="lora_gate", shape=(), dtype="float32")

    def get_config(self):
        return super().get_config()  # overridden: Keras saves none of `__init__`'s arguments, `required` missed

    def call(self, x):
        return x @ self.kernel


def test_fixed_dtype_variables_fall_back_on_loras_names_where_the_layer_cannot_be_rebuilt():
    """No rebuild to read dtypes from: the variables named `lora_*` are the fixed ones, whatever their dtype."""
    layer = _NoRebuild(required=1)
    layer.build((None, 4))
    with pytest.raises(TypeError):
        _NoRebuild.from_config(layer.get_config())  # the premise: it cannot be rebuilt
    assert fixed_dtype_variables(layer, keras.DTypePolicy("bfloat16")) == {id(layer.lora_scale), id(layer.lora_gate)}


def test_placing_a_placed_keras_hub_lm_again_drops_the_earlier_placements_maps():
    """The maps an O1-bfloat16 placement gave the blocks held their layers in bfloat16 through a float32 placement."""
    import kmix

    keras_hub = pytest.importorskip("keras_hub")

    def build():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.Qwen2Backbone(vocabulary_size=64, num_layers=1, num_query_heads=2,
                                                  num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)
        return keras_hub.models.Qwen2CausalLM(backbone=backbone, preprocessor=None)

    x = {"token_ids": np.arange(16).reshape(2, 8) % 64, "padding_mask": np.ones((2, 8), "int32")}
    # Compute dtypes in layer order: a second model's paths differ by Keras's name counters.
    dtypes = lambda lm: [layer.compute_dtype for _, layer, _ in walk(lm)]  # noqa: E731
    lm = build()
    float32 = keras.ops.convert_to_numpy(lm(x))
    kmix.autocast(lm, "O1-bfloat16")
    assert "bfloat16" in dtypes(lm)
    kmix.autocast(lm, "float32")
    assert set(dtypes(lm)) == {"float32"}
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(lm(x)), float32)  # the float32 model, bitwise
    kmix.autocast(lm, "O1")  # another half: as a fresh model placed so
    assert dtypes(lm) == dtypes(kmix.autocast(build(), "O1"))
