"""What trains is what reloads: `kmix.autocast` settles the placed model on its twin, as `load_model` rebuilds it.

Small models that fail the way keras-hub's architectures did: a functional
subclass whose constructor bakes a dtype into a `keras.ops` node (Gemma), a
layer caching what it computed from its inputs (SD3's scheduler), a
mixture-of-experts router, a float32 island whose block multiplies it with
half tensors (GPT-OSS), a symbolic call that fails for a reason other than
dtypes (RWKV's `range` over the sequence length). Each is checked against a
float32 model or a reload, never only "it ran".
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import kmix
from tests.testing import assert_placement_survives_reload


@keras.saving.register_keras_serializable(package="kmix_tests")
class ScaledEmbedder(keras.Model):
    """A functional subclass as keras-hub writes them: `x * cast(sqrt(d), x.dtype)` baked at build."""

    def __init__(self, vocabulary=20, dim=6, **kwargs):
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        embedding = keras.layers.Embedding(vocabulary, dim, name="embedding", dtype=kwargs.get("dtype"))
        x = embedding(tokens)
        x = x * ops.cast(ops.sqrt(float(dim)), x.dtype)  # float32 in a float32 build: a constant node
        x = keras.layers.Dense(dim, name="proj", dtype=kwargs.get("dtype"))(x)
        super().__init__(tokens, x, **kwargs)
        self.vocabulary, self.dim = vocabulary, dim

    def get_config(self):
        return {"vocabulary": self.vocabulary, "dim": self.dim, "name": self.name, "trainable": self.trainable,
                "dtype": keras.saving.serialize_keras_object(self.dtype_policy)}


def tokens():
    return np.random.default_rng(0).integers(0, 20, (3, 5)).astype("int32")


def test_a_constant_baked_into_the_graph_is_rebuilt_as_a_reload_makes_it():
    model = ScaledEmbedder()
    kmix.autocast(model, "O1-bfloat16")
    x = tokens()
    # In memory and reloaded: the same predictions bit for bit, no warning needed.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        kmix.autocast(ScaledEmbedder(), "O1-bfloat16")
    assert_placement_survives_reload(model, x)
    # sqrt(6) in bfloat16, as a model built under the policy has it: Keras's own build, kmix's islands on top.
    with kmix.policy_scope("mixed_bfloat16"):
        keras_built = ScaledEmbedder()
    keras_built.set_weights(model.get_weights())
    keras_built = kmix.autocast(keras_built, "O1-bfloat16")
    np.testing.assert_array_equal(ops.convert_to_numpy(model(x)), ops.convert_to_numpy(keras_built(x)))



def test_without_the_rebuilt_constant_the_reload_would_differ(monkeypatch):
    from kmix.placing import twin

    monkeypatch.setattr(twin, "_graph_edits", lambda pairs: ([], []))
    model = ScaledEmbedder()
    with pytest.warns(UserWarning, match="predicts up to"):  # the numerical check sees it
        kmix.autocast(model, "O1-bfloat16")
    with pytest.raises(AssertionError, match="in memory vs reloaded"):
        assert_placement_survives_reload(model, tokens())


class StepCache(keras.layers.Layer):
    """Caches a table computed from its input's value (keras-hub's flow-matching scheduler does)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = None

    def call(self, x, steps):
        if self.table is None and tf.executing_eagerly():
            self.table = ops.cast(ops.arange(ops.max(steps) + 1), "float32")
        if self.table is None:  # a graph traced before any eager call: no table yet
            return x
        return x * ops.cast(ops.sum(self.table), x.dtype)


def test_the_checks_leave_no_cached_tensor_behind():
    x_in, steps_in = keras.Input((4,), name="x"), keras.Input((), dtype="int32", name="steps")
    h = keras.layers.Dense(4, name="proj")(x_in)
    model = keras.Model([x_in, steps_in], keras.layers.Dense(2, name="head")(StepCache(name="cache")(h, steps_in)))
    x = [np.ones((2, 4), "float32"), np.full((2,), 3, "int32")]
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    kmix.autocast(model, "O1-bfloat16")
    assert model.get_layer("cache").table is None  # the symbolic call and the reload check left nothing
    got, expected = ops.convert_to_numpy(model(x)), ops.convert_to_numpy(reference(x))
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


@keras.saving.register_keras_serializable(package="kmix_tests")
class TinySparseMoeBlock(keras.layers.Layer):
    """Two experts and a router, combined as keras-hub's Mixtral combines them."""

    def __init__(self, hidden=8, experts=2, scale_by_router=False, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.experts, self.scale_by_router = hidden, experts, scale_by_router
        self.gate = keras.layers.Dense(experts, name="sparse_feedforward_gate_dense", dtype=self.dtype_policy)
        self.expert = [keras.layers.Dense(hidden, name=f"expert_{i}", dtype=self.dtype_policy) for i in range(experts)]

    def build(self, shape):
        self.gate.build(shape)
        for expert in self.expert:
            expert.build(shape)

    def call(self, x):
        probs = ops.softmax(self.gate(x), axis=-1)
        top, index = ops.top_k(probs, k=1)
        outs = ops.stack([expert(x) for expert in self.expert], axis=-1)
        if self.scale_by_router:  # GPT-OSS multiplies raw, with no cast: the router's dtype must be x's
            weights = ops.one_hot(index[..., 0], self.experts, dtype=top.dtype) * top
            return ops.sum(outs * ops.expand_dims(weights, -2), axis=-1)
        chosen = ops.cast(ops.one_hot(index[..., 0], self.experts, dtype=top.dtype) * top, x.dtype)
        return ops.sum(outs * ops.expand_dims(chosen, -2), axis=-1)

    def get_config(self):
        return {**super().get_config(), "hidden": self.hidden, "experts": self.experts,
                "scale_by_router": self.scale_by_router}


def moe_model(scale_by_router=False):
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(8, name="embed")(inputs)
    h = TinySparseMoeBlock(scale_by_router=scale_by_router, name="moe")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def test_a_router_computes_in_float32_and_picks_the_experts_float32_picks():
    model = moe_model()
    x = np.random.default_rng(1).normal(size=(64, 8)).astype("float32")
    choice32 = ops.convert_to_numpy(ops.argmax(model.get_layer("moe").gate(model.get_layer("embed")(x)), -1))
    _, table = kmix.autocast(model, "O1", return_table=True)
    row = {r.layer: r for r in table}["moe/sparse_feedforward_gate_dense"]
    assert row.after == "float32" and row.reason.startswith("router"), row
    assert model.get_layer("moe").expert[0].compute_dtype == "float16"
    gate_in = model.get_layer("embed")(x)
    logits = model.get_layer("moe").gate(gate_in)
    assert logits.dtype == "float32"  # the softmax and top-k after it run in float32 too
    choice = ops.convert_to_numpy(ops.argmax(logits, -1))
    assert (choice == choice32).mean() >= 0.95  # the embedding's half rounding may flip a near tie
    assert_placement_survives_reload(model, x[:4])


def test_a_router_whose_block_multiplies_it_raw_takes_the_blocks_dtype_and_says_so():
    model = moe_model(scale_by_router=True)
    x = np.random.default_rng(2).normal(size=(4, 8)).astype("float32")
    expected = ops.convert_to_numpy(model(x))
    with pytest.warns(UserWarning, match=r"computes \['moe/sparse_feedforward_gate_dense'\] as their blocks do"):
        kmix.autocast(model, "O1")
    assert model.get_layer("moe").gate.compute_dtype == "float16"
    got = ops.convert_to_numpy(model(x))
    np.testing.assert_allclose(got, expected, atol=1e-2 * np.abs(expected).max())
    assert_placement_survives_reload(model, x)


@keras.saving.register_keras_serializable(package="kmix_tests")
class SignGate(keras.layers.Layer):
    """Branches in Python on a tensor's value: a graph trace of it fails, in any dtype (Qwen 3.5's does)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, name="dense", dtype=self.dtype_policy)

    def build(self, shape):
        self.dense.build(shape)

    def call(self, x):
        h = self.dense(x)
        return h if bool(ops.convert_to_numpy(ops.any(h > 0))) else -h

    def compute_output_shape(self, shape):
        return shape[:-1] + (4,)


def test_a_symbolic_call_failing_for_no_dtype_reason_keeps_nothing_in_float32():
    inputs = keras.Input((None, 4), name="x")
    model = keras.Model(inputs, SignGate(name="steps")(inputs))
    x = np.random.default_rng(3).normal(size=(2, 3, 4)).astype("float32")
    expected = ops.convert_to_numpy(model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "fails in half" warning
        kmix.autocast(model, "O1-bfloat16")
    assert model.get_layer("steps").dense.compute_dtype == "bfloat16"
    np.testing.assert_allclose(ops.convert_to_numpy(model(x)).astype("float32"), expected, atol=3e-2)
