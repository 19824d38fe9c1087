"""kmix.autocast: places the user's own model in place, moves exactly the listed layers, keeps the predictions."""

import keras
import numpy as np
import pytest

import kmix
from kmix import autocast
from kmix.layers import WithPolicy
from tests.testing import assert_model_round_trip, assert_placement_survives_reload


def transformer_block():
    """A float32 model with one layer of each kind autocast tells apart."""
    inputs = keras.Input((6, 8), name="x")
    h = keras.layers.Dense(16, name="proj")(inputs)
    h = keras.layers.LayerNormalization(name="ln")(h)
    a = keras.layers.MultiHeadAttention(2, 8, name="mha")(h, h)
    h = keras.layers.Add(name="add")([h, a])
    h = keras.layers.Conv1D(8, 3, padding="same", name="conv")(h)
    s = keras.layers.Softmax(name="sm")(keras.layers.Dense(6, name="scores")(h))
    p = keras.layers.Activation("softmax", name="probs")(keras.layers.Dense(4, name="pre_probs")(h))
    h = keras.layers.Concatenate(name="cat")([s, p])
    h = keras.layers.Flatten(name="flat")(h)
    logits = keras.layers.Dense(3, name="logits")(h)
    log_probs = keras.layers.Activation("log_softmax", name="log_probs")(logits)
    return keras.Model(inputs, [logits, log_probs], name="block")


# Written out by hand from the rules: name -> (policy after O1, class after).
EXPECTED_O1 = {
    "proj": ("mixed_float16", keras.layers.Dense),
    "ln": ("float32", keras.layers.LayerNormalization),
    "mha": ("mixed_float16", kmix.layers.MultiHeadAttention),
    "add": ("mixed_float16", keras.layers.Add),
    "conv": ("mixed_float16", keras.layers.Conv1D),
    "scores": ("mixed_float16", keras.layers.Dense),
    "sm": ("mixed_float16", kmix.layers.Softmax),
    "pre_probs": ("mixed_float16", keras.layers.Dense),
    "probs": ("float32", keras.layers.Activation),
    "cat": ("mixed_float16", keras.layers.Concatenate),
    "flat": ("mixed_float16", keras.layers.Flatten),
    "logits": ("mixed_float16", keras.layers.Dense),  # produces an output: half matmul, float32 out
    "log_probs": ("float32", keras.layers.Activation),
}


# Worst error of a prediction, relative to the float32 output's largest value (as in test_real_models).
TOLERANCE = {"float16": 3e-2, "bfloat16": 1.2e-1}
LEVELS = ["O1", "O2", "mixed_bfloat16"]


def policy_name(layer):
    """The Keras policy name a layer computes under, from its public dtypes (it may hold a map)."""
    variable, compute = layer.variable_dtype, layer.compute_dtype
    return variable if variable == compute else f"mixed_{compute}"


def placements(model):
    return {
        layer.name: (policy_name(layer), type(layer))
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    }


def call(model, x):
    """`model(x, training=False)` as NumPy (a list for several outputs): a reference needs no `predict` trace."""
    return keras.tree.map_structure(keras.ops.convert_to_numpy, model(x, training=False))


def sample(shape=(4, 6, 8), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def test_o1_moves_exactly_the_listed_layers():
    model = transformer_block()
    weights = list(model.weights)
    new, table = autocast(model, "O1", return_table=True)
    assert new is model  # placed in place: the same object, the same variables
    assert all(a is b for a, b in zip(model.weights, weights)) and len(model.weights) == len(weights)
    assert placements(new) == EXPECTED_O1
    top = [row for row in table if "/" not in row.layer]
    assert {row.layer: row.after for row in top} == {k: v[0] for k, v in EXPECTED_O1.items()}
    assert all(row.before == "float32" for row in table)
    moved = [name for name in table.moved() if "/" not in name]
    assert sorted(moved) == sorted(k for k, (p, _) in EXPECTED_O1.items() if p != "float32")
    # Nested layers have rows too: the attention's projections follow it into half.
    nested = {row.layer: row.after for row in table if row.layer.startswith("mha/")}
    assert nested["mha/query"] == nested["mha/attention_output"] == "mixed_float16"


def test_copy_leaves_the_model_as_it_was():
    model = transformer_block()
    x = sample()
    expected = model.predict(x, verbose=0)  # traces the original's predict function, used again below
    copy = autocast(model, "O1", copy=True)
    assert copy is not model and type(copy) is type(model)
    assert placements(copy) == EXPECTED_O1
    assert {p for p, _ in placements(model).values()} == {"float32"}  # the original is untouched
    assert type(model.get_layer("mha")) is keras.layers.MultiHeadAttention
    for e, g in zip(expected, model.predict(x, verbose=0)):
        np.testing.assert_array_equal(g, e)
    for e, g in zip(expected, call(copy, x)):
        np.testing.assert_allclose(g, e, atol=2e-2 * np.abs(e).max())


def test_same_predictions_within_half_rounding():
    x = sample()
    for policy, tol in (("O1", 2e-2), (kmix.Policy("O1", half="bfloat16"), 1e-1)):
        model = transformer_block()
        expected = call(model, x)  # the float32 reference, eagerly: no predict trace
        got = autocast(model, policy).predict(x, verbose=0)
        for e, g in zip(expected, got):
            assert g.dtype == np.float32  # output layers run in float32
            np.testing.assert_allclose(g, e, atol=tol * np.abs(e).max())


def test_o2_recasts_the_same_variables():
    model = transformer_block()
    kernel = model.get_layer("proj").kernel
    before = {id(v): keras.ops.convert_to_numpy(v) for v in model.weights}
    new = autocast(model, "O2")
    assert new is model and model.get_layer("proj").kernel is kernel  # the user's handle, recast
    for v in model.weights:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(v), before[id(v)].astype(v.dtype))
    assert kernel.dtype == "float16"  # O2: half params
    assert model.get_layer("ln").gamma.dtype == "float32"  # normalization in float32


def test_o2_after_the_optimizer_is_built_places_a_copy():
    model = transformer_block()
    model.compile(optimizer="adam", loss=["mse", None])
    model.optimizer.build(model.trainable_variables)
    with pytest.warns(UserWarning, match="optimizer Adam is built.*placed a copy"):
        new = autocast(model, "O2")
    assert new is not model and new.get_layer("proj").kernel.dtype == "float16"
    assert model.get_layer("proj").kernel.dtype == "float32"


def test_float32_layers_by_class_and_name():
    new, table = autocast(transformer_block(), "O1", float32_layers=[keras.layers.Conv1D, "cat"], return_table=True)
    expected = dict(EXPECTED_O1, conv=("float32", keras.layers.Conv1D), cat=("float32", keras.layers.Concatenate))
    assert placements(new) == expected
    assert {row.layer: row.reason for row in table}["cat"] == "float32_layers"


def test_unknown_name_and_bad_entries():
    with pytest.raises(ValueError, match=r"\['nope'\].*Its layers are"):
        autocast(transformer_block(), float32_layers=["nope"])
    with pytest.raises(TypeError, match="float32_layers"):
        autocast(transformer_block(), float32_layers=[3])


def test_o3_is_pure_half_and_o0_pure_float32():
    keras.config.set_dtype_policy("mixed_float16")
    model = transformer_block()
    keras.config.set_dtype_policy("float32")
    classes = {k: type(model.get_layer(k)) for k in EXPECTED_O1}
    pure = placements(autocast(model, "O3"))
    assert pure == {k: ("float16", classes[k]) for k in EXPECTED_O1}  # no swaps either
    full = placements(autocast(model, "O0"))
    assert {p for p, _ in full.values()} == {"float32"}
    assert all(v.dtype == "float32" for v in model.weights)  # O0 after O3: float32 variables again


def test_sequential_stays_sequential():
    seq = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization(), keras.layers.Dense(2)],
        name="seq",
    )
    x = sample((3, 4))
    expected = call(seq, x)
    new = autocast(seq, "O1")
    assert new is seq
    # The last Dense produces the output: its matmul in half, its output float32.
    assert [policy_name(layer) for layer in new.layers] == ["mixed_float16", "float32", "mixed_float16"]
    got = new.predict(x, verbose=0)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="not built"):
        autocast(keras.Sequential([keras.layers.Dense(2)]))


class Net(keras.Model):
    """A subclassed model: its graph is known only by calling it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(8, name="proj")
        self.norm = keras.layers.BatchNormalization(name="norm")
        self.out = keras.layers.Dense(2, name="out")

    def call(self, x, training=False):
        return self.out(self.norm(self.proj(x), training=training))


def test_subclassed_model_is_placed_with_its_output_layer_found():
    net = Net(name="net")
    x = sample((5, 4))
    expected = keras.ops.convert_to_numpy(net(x))
    new, table = autocast(net, "O2", return_table=True)
    assert new is net
    rows = {row.layer: row for row in table}
    # Found by a symbolic call; made by the model's constructor, so a reload would not keep a float32-out
    # activation: float32.
    assert rows["out"].after == "float32" and rows["out"].reason == "model output"
    # Its layers are applied by its own `call`, as a block's: the norm keeps float32 statistics and
    # variables and hands back the half dtype its raw arithmetic may add to.
    assert rows["norm"].after == "mixed_float16" and rows["proj"].after == "float16"
    assert net.proj.kernel.dtype == "float16" and {v.dtype for v in net.norm.weights} == {"float32"}
    got = net(x)
    assert got.dtype == "float32"
    np.testing.assert_allclose(keras.ops.convert_to_numpy(got), expected, atol=2e-2 * np.abs(expected).max())


def test_nested_model_and_with_policy():
    inner_in = keras.Input((8,))
    inner = keras.Model(inner_in, keras.layers.Dense(4, name="inner_out")(keras.layers.Dense(8, name="inner_a")(inner_in)), name="inner")
    inputs = keras.Input((8,))
    h = WithPolicy(keras.layers.Dense(8, name="kept"), "O2", name="wp")(inputs)
    model = keras.Model(inputs, inner(h))
    new2 = autocast(keras.models.clone_model(model), "O1", float32_layers=["inner"])
    new, table = autocast(model, "O1", return_table=True)
    rows = {row.layer: row for row in table}
    assert rows["wp"].after == "float16" and rows["wp"].reason == "WithPolicy: kept"
    assert rows["inner/inner_a"].after == "mixed_float16"
    assert rows["inner/inner_out"].after == "mixed_float16"  # it produces the outer model's output:
    assert new.get_layer("inner").get_layer("inner_out").activation is kmix.ops.float32_out.float32_linear  # float32 out
    assert policy_name(new2.get_layer("inner").get_layer("inner_a")) == "float32"


def test_shared_layers_and_lambdas_with_closures():
    scale = 3.0
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    h = keras.layers.Lambda(lambda t: t * scale, name="times_scale")(shared(shared(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(h))
    x = sample((3, 4))
    expected = call(model, x)
    new = autocast(model, "O1")
    assert new.get_layer("times_scale").function(2.0) == 6.0  # the user's own function, closure included
    assert len(new.get_layer("shared").weights) == 2  # still one shared layer
    np.testing.assert_allclose(new.predict(x, verbose=0), expected, rtol=2e-2, atol=2e-2)


def test_table_is_printed(capsys):
    autocast(transformer_block(), "O1", verbose=True)
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["layer", "class", "before", "after", "why"]
    assert "MultiHeadAttention -> kmix.layers.MultiHeadAttention" in out


def test_result_saves_and_trains():
    new = autocast(transformer_block(), "O1")
    x = sample((8, 6, 8))
    y = np.random.default_rng(1).normal(size=(8, 3)).astype("float32")
    with kmix.policy_scope("O1"):
        new.compile(optimizer=kmix.wrap(keras.optimizers.Adam(1e-3)), loss=["mse", None])
    new.optimizer.build(new.trainable_variables)  # built before fit: one trace of the train step, not two
    loss = np.mean((call(new, x)[0].astype("float64") - y) ** 2)  # the compiled loss, by hand: mse of output 0
    history = new.fit(x, [y, y], epochs=3, verbose=0)
    assert np.isfinite(history.history["loss"]).all() and history.history["loss"][-1] < loss
    assert_model_round_trip(new, x)


def test_ops_nodes_keep_their_place():
    inputs = keras.Input((6, 8), name="x")
    h = keras.layers.Dense(16, name="proj")(inputs)
    pooled = keras.ops.mean(h, axis=1)  # an ops node between two layers
    normed = keras.layers.LayerNormalization(name="norm")(pooled)
    mixed = normed * 2.0 + pooled  # arithmetic between a float32 and a half tensor
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(mixed[:, :8]))
    kinds = [type(op).__name__ for op in model.operations]
    x = sample()
    expected = call(model, x)
    new = autocast(model, "O1")
    assert [type(op).__name__ for op in new.operations] == kinds
    assert {"Mean", "Multiply", "Add", "GetItem"} <= set(kinds)
    assert new.get_layer("proj").compute_dtype == "float16" and new.get_layer("norm").compute_dtype == "float32"
    # Behind the slice, it produces the output: its matmul in half, its output float32.
    got = new.predict(x, verbose=0)
    assert new.get_layer("head").compute_dtype == "float16" and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=2e-2)


def test_layers_that_cannot_be_placed_are_reported(recwarn):
    class FixedBlock(keras.layers.Layer):
        """A block that builds its normalization with a fixed float16 dtype."""

        def build(self, input_shape):
            self.norm = keras.layers.LayerNormalization(dtype="float16", name="norm")
            self.norm.build(input_shape)

        def call(self, x):
            return self.norm(x)

    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(FixedBlock(name="block")(inputs)))
    _, table = autocast(model, "O2", return_table=True)
    row = {r.layer: r for r in table}["block/norm"]
    # Its block makes it float16, and so does a reload: it computes so in memory too (what trains is
    # what reloads); the table and one warning say so.
    assert row.after == "float16" and "its block makes it so" in row.reason, row
    assert model.get_layer("block").norm.compute_dtype == "float16"
    messages = [str(w.message) for w in recwarn if "kmix.autocast" in str(w.message)]
    assert len(messages) == 1 and "block/norm" in messages[0] and "planned mixed_float16" in messages[0], messages


def test_a_block_wrapped_in_remat_is_placed_inside(recwarn):
    keras_hub = pytest.importorskip("keras_hub")
    inputs = keras.Input((6, 16))
    mask = keras.Input((6,), dtype="int32")
    block = keras_hub.layers.TransformerEncoder(32, 2, name="enc")
    h = kmix.layers.Remat(block, name="remat_enc")(inputs, padding_mask=mask)
    model = keras.Model([inputs, mask], keras.layers.Dense(2, name="head")(h[:, 0]))
    x = [sample((3, 6, 16)), np.ones((3, 6), "int32")]
    expected = call(model, x)
    new = autocast(model, "O2")
    assert not [w for w in recwarn if "kmix.autocast" in str(w.message)]
    norms = [v for v in new.weights if "layer_norm" in v.path]
    assert norms and all(v.dtype == "float32" for v in norms)
    assert isinstance(new.get_layer("remat_enc"), kmix.layers.Remat)
    np.testing.assert_allclose(new.predict(x, verbose=0), expected, atol=2e-2)
    assert_model_round_trip(new, x)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_float32_layers_keep_their_constants_in_float32(level):
    """A Normalization of raw inputs near 1e5: its mean (90000) is inf in float16.

    The layer computes in float32, so its constants (and statistics) must be
    float32 too, in memory as after a reload: the copy predicts like the
    float32 model, never NaN.
    """
    inputs = keras.Input((4,), name="x")
    h = keras.layers.Normalization(mean=90000.0, variance=4e8, name="norm")(inputs)
    h = keras.layers.Dense(8, activation="relu", name="hidden")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(h), name="raw_inputs")
    x = np.random.default_rng(0).normal(9e4, 2e4, size=(8, 4)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(x, training=False)).astype("float64")

    new = autocast(model, level)
    norm = new.get_layer("norm")
    assert norm.compute_dtype == "float32"
    assert keras.backend.standardize_dtype(norm.mean.dtype) == "float32", norm.mean.dtype
    assert keras.backend.standardize_dtype(norm.variance.dtype) == "float32", norm.variance.dtype
    assert all(v.dtype == "float32" for v in norm.weights)
    assert new.get_layer("hidden").compute_dtype == "float16"  # the rest is placed as usual
    got = new(x, training=False)
    values = keras.ops.convert_to_numpy(got).astype("float64")
    assert np.isfinite(values).all(), values
    np.testing.assert_allclose(values, expected, atol=TOLERANCE["float16"] * np.abs(expected).max(), rtol=0)
    assert_placement_survives_reload(new, x, outputs=got)


@pytest.mark.parametrize("level", LEVELS)
def test_ops_add_of_a_number_beside_an_add_layer(level):
    """MobileNetV3's hard-swish `h + 3.0` (a keras.ops node) in a model that has an `Add` layer too."""
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(8, name="proj")(inputs)
    swish = h * keras.layers.ReLU(6.0, name="relu6")(h + 3.0) * (1.0 / 6.0)
    h = keras.layers.Add(name="residual")([h, swish])
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(h), name="hard_swish")
    kinds = [type(op).__name__ for op in model.operations]
    assert "Add" in kinds and any(isinstance(op, keras.layers.Add) for op in model.operations)
    x = sample((4, 8))
    expected = keras.ops.convert_to_numpy(model(x, training=False)).astype("float64")

    new = autocast(model, level)
    assert [type(op).__name__ for op in new.operations] == kinds  # the ops add stays an ops add
    got = new(x, training=False)
    tolerance = TOLERANCE[kmix.Policy(level).compute_dtype] * np.abs(expected).max()
    np.testing.assert_allclose(keras.ops.convert_to_numpy(got).astype("float64"), expected, atol=tolerance, rtol=0)
    assert_placement_survives_reload(new, x, outputs=got)
