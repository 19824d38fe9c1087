"""Unit tests of `kmix._tree`, the one layer-tree walker: each function against a hand-written expectation."""

import keras
import numpy as np
import pytest

from kmix._tree import digest, is_auto_named, is_graph_model, own_weights, pair, resolved_policy, snake_case, walk


class Block(keras.layers.Layer):
    """A custom layer with a sublayer made in `__init__`, one made in `build`, and a variable of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = keras.layers.Dense(3, name="first")

    def build(self, input_shape):
        self.second = keras.layers.Dense(2, name="second")
        self.first.build(input_shape)
        self.second.build((None, 3))
        self.scale = self.add_weight(name="scale", shape=(2,), initializer="ones")

    def call(self, x):
        return self.second(self.first(x)) * self.scale


class Subclassed(keras.Model):
    """A subclassed model holding a custom block and one Dense under two attributes (walked once)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = Block(name="block")
        self.head = keras.layers.Dense(1, name="head")
        self.same_head = self.head

    def call(self, x):
        return self.head(self.block(x))


def _paths(root):
    return [path for path, _, _ in walk(root)]


def _nested_functional():
    """`outer`: a Sequential `seq` [d1, d2], a functional `inner` [Input, d3], and `top`, in a functional model."""
    seq = keras.Sequential([keras.layers.Dense(3, name="d1"), keras.layers.Dense(3, name="d2")], name="seq")
    x_in = keras.Input((3,), name="inner_x")
    inner = keras.Model(x_in, keras.layers.Dense(2, name="d3")(x_in), name="inner")
    x = keras.Input((4,), name="x")
    return keras.Model(x, keras.layers.Dense(1, name="top")(inner(seq(x))), name="outer")


def test_walk_on_nested_graph_models_lists_each_layer_depth_first_with_parents_and_no_input_layers():
    """Nested Sequential / functional models: paths, layers and parents as written by hand, no `InputLayer`."""
    model = _nested_functional()
    rows = list(walk(model))
    seq, inner, top = model.get_layer("seq"), model.get_layer("inner"), model.get_layer("top")
    expected = [
        ("seq", seq, model),
        ("seq/d1", seq.get_layer("d1"), seq),
        ("seq/d2", seq.get_layer("d2"), seq),
        ("inner", inner, model),
        ("inner/d3", inner.get_layer("d3"), inner),
        ("top", top, model),
    ]
    assert [path for path, _, _ in rows] == [path for path, _, _ in expected]
    for (_, layer, parent), (path, want_layer, want_parent) in zip(rows, expected):
        assert layer is want_layer and parent is want_parent, path
    assert not any(isinstance(layer, keras.layers.InputLayer) for _, layer, _ in rows)


def test_walk_on_a_subclassed_model_finds_layers_made_in_build_and_a_shared_layer_once():
    """Before the build only the `__init__` layers; after it the one `Block.build` made too; `head` once."""
    model = Subclassed(name="sub")
    assert _paths(model) == ["block", "block/first", "head"]
    model(np.zeros((2, 4), "float32"))
    assert _paths(model) == ["block", "block/first", "block/second", "head"]
    parents = {path: parent for path, _, parent in walk(model)}
    assert parents["block/second"] is model.block and parents["head"] is model


def test_walk_of_an_empty_model_or_a_plain_layer_yields_nothing():
    assert list(walk(keras.Sequential([], name="empty"))) == []
    assert list(walk(keras.layers.Dense(2))) == []


def test_own_weights_are_the_variables_no_sublayer_holds():
    """`Block` holds `scale` itself; its Dense kernels and biases are its sublayers'; a Dense holds both its own."""
    block = Block(name="block")
    block.build((None, 4))
    assert [w.path for w in own_weights(block)] == ["block/scale"]
    assert {id(w) for w in own_weights(block.first)} == {id(block.first.kernel), id(block.first.bias)}
    model = Subclassed(name="sub")
    model(np.zeros((2, 4), "float32"))
    assert own_weights(model) == []
    assert len(model.weights) == 7  # 2 Dense in the block + scale + the head's 2: all held below the model


def test_resolved_policy_reads_a_policy_map_by_the_layers_path_as_keras_does():
    """A map keyed by path gives `d1` its entry and `d2` the default; a plain policy is returned as is."""
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    policy_map["d1"] = keras.DTypePolicy("mixed_bfloat16")  # a functional model's layers have their own name as path
    x = keras.Input((4,))
    d1 = keras.layers.Dense(3, name="d1", dtype=policy_map)
    d2 = keras.layers.Dense(3, name="d2", dtype=policy_map)
    keras.Model(x, d2(d1(x)))
    assert resolved_policy(d1).name == "mixed_bfloat16" and d1.compute_dtype == "bfloat16"
    assert resolved_policy(d2).name == "float32" and d2.compute_dtype == "float32"
    unbuilt = keras.layers.Dense(3, dtype=policy_map)  # no path yet: the map's default
    assert unbuilt.path is None and resolved_policy(unbuilt) is policy_map.default_policy
    plain = keras.layers.Dense(3, dtype="mixed_float16")
    assert resolved_policy(plain) is plain.dtype_policy and resolved_policy(plain).name == "mixed_float16"


def test_is_graph_model_tells_sequential_and_functional_from_subclassed_and_layers():
    model = _nested_functional()
    assert is_graph_model(model) and is_graph_model(model.get_layer("seq")) and is_graph_model(keras.Sequential())
    assert not is_graph_model(Subclassed()) and not is_graph_model(keras.layers.Dense(1))


@pytest.mark.parametrize("class_name, expected", [
    ("Dense", "dense"),
    ("T5LayerNorm", "t5_layer_norm"),
    ("MultiHeadAttention", "multi_head_attention"),
    ("Conv2D", "conv2d"),
    ("Conv2DTranspose", "conv2d_transpose"),
    ("PReLU", "p_re_lu"),
    ("HTTPServer", "http_server"),
    ("LSTM", "lstm"),
    ("my.Class", "my_class"),  # non-word characters dropped first
    ("already_snake", "already_snake"),
])
def test_snake_case_against_hand_written_cases(class_name, expected):
    assert snake_case(class_name) == expected


def test_snake_case_is_the_name_keras_gives_an_unnamed_layer():
    """Keras's own naming is the reference: the first unnamed layer of a class (a fresh session) is `snake_case`."""
    layers = [keras.layers.Dense(2), keras.layers.LayerNormalization(), keras.layers.PReLU(), keras.layers.GRU(2),
              keras.layers.MultiHeadAttention(2, 2), keras.layers.Conv2DTranspose(2, 2)]
    assert [layer.name for layer in layers] == [snake_case(type(layer).__name__) for layer in layers]
    assert [layer.name for layer in layers] == [
        "dense", "layer_normalization", "p_re_lu", "gru", "multi_head_attention", "conv2d_transpose"]


def test_is_auto_named_accepts_keras_counter_names_only():
    class MyDense(keras.layers.Dense):
        pass

    first, second = keras.layers.Dense(1), keras.layers.Dense(1)
    assert is_auto_named(first) and is_auto_named(second) and second.name != first.name
    assert is_auto_named(MyDense(1)) and MyDense(1).name.startswith("my_dense")
    for name in ("dense_3", "dense"):
        assert is_auto_named(keras.layers.Dense(1, name=name))
    for name in ("head", "dense_x", "dense_1_2", "dense3", "my_dense", "xdense"):
        assert not is_auto_named(keras.layers.Dense(1, name=name)), name
    assert not is_auto_named(None)


def _two_dense(name, extra=False):
    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(3, name="d1")(x)
    if extra:
        h = keras.layers.Dense(3, name="extra")(h)
    return keras.Model(x, keras.layers.Dense(2, name="d2")(h), name=name)


def test_pair_matches_a_twin_by_position_root_first():
    model = _two_dense("m")
    twin = keras.Model.from_config(model.get_config())
    rows = pair(model, twin)
    assert [(path, layer.name, parent, other.name) for path, layer, parent, other in rows] == [
        ("m", "m", None, "m"), ("d1", "d1", model, "d1"), ("d2", "d2", model, "d2")]
    assert rows[0][3] is twin and rows[1][3] is twin.get_layer("d1") and rows[2][3] is twin.get_layer("d2")
    assert all(layer is not other for _, layer, _, other in rows)


def test_pair_with_no_twin_or_another_count_of_layers_pairs_none_unless_by_path():
    model = _two_dense("m")
    other = _two_dense("other", extra=True)  # one layer more: positions do not line up
    assert [row[3] for row in pair(model, None)] == [None, None, None]
    assert [row[3] for row in pair(model, other)] == [None, None, None]
    by_path = pair(model, other, by_path=True)
    assert [path for path, *_ in by_path] == ["m", "d1", "d2"]
    assert by_path[0][3] is other  # the roots pair whatever their names: the twin is the root rebuilt
    assert by_path[1][3] is other.get_layer("d1") and by_path[2][3] is other.get_layer("d2")


def test_pair_by_path_on_subclassed_models_strips_each_roots_name():
    """Nested layers' Keras paths start with their root's name (`a/block/first`): paired relative to the roots."""
    model, twin = Subclassed(name="a"), Subclassed(name="b")
    twin.extra = keras.layers.Dense(1, name="extra")  # one layer more: no pairing by position
    twin.extra.build((None, 1))
    model(np.zeros((1, 4), "float32"))
    twin(np.zeros((1, 4), "float32"))
    rows = pair(model, twin, by_path=True)
    assert [path for path, *_ in rows] == ["a", "block", "block/first", "block/second", "head"]
    assert [other for *_, other in rows[1:]] == [twin.block, twin.block.first, twin.block.second, twin.head]


def test_pair_by_path_never_pairs_a_root_with_a_layer_of_the_twin():
    model, twin = Subclassed(name="block"), Subclassed(name="b")  # the root is named like the twin's `block`
    twin.extra = keras.layers.Dense(1, name="extra")
    twin.extra.build((None, 1))
    model(np.zeros((1, 4), "float32"))
    twin(np.zeros((1, 4), "float32"))
    rows = pair(model, twin, by_path=True)
    assert rows[1][3] is twin.block  # the model's own `block` pairs right
    assert rows[0][3] is not twin.block


def test_pair_by_path_pairs_unbuilt_layers_under_a_step_named_like_the_root():
    model, twin = Subclassed(name="block"), Subclassed(name="b")  # never called: no layer has a Keras path
    twin.extra = keras.layers.Dense(1, name="extra")
    assert model.block.first.path is None
    rows = {path: other for path, _, _, other in pair(model, twin, by_path=True)}
    assert rows["head"] is twin.head  # no prefix to strip: pairs right
    assert rows["block/first"] is twin.block.first


def test_digest_is_equal_while_a_value_is_unchanged_and_differs_on_any_change():
    v = keras.Variable(np.arange(6, dtype="float32").reshape(2, 3))
    before = digest(v)
    assert before == digest(np.arange(6, dtype="float32").reshape(2, 3))  # a NumPy array as well as a variable
    assert before[:2] == ("<f4", (2, 3))
    v.assign(v.numpy() + np.float32(0) * v.numpy())
    assert digest(v) == before
    changed = v.numpy().copy()
    changed[1, 2] = np.nextafter(changed[1, 2], np.float32(np.inf))  # one spacing on one element
    assert digest(changed) != before
    assert digest(v.numpy().reshape(3, 2)) != before  # same bytes, other shape
    assert digest(v.numpy().astype("float64")) != before
    assert digest(np.asfortranarray(v.numpy())) == before  # the value, not its layout in memory
