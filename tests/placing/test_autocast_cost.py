"""What `kmix.autocast` costs in memory, counted rather than timed: no second copy of the weights.

The check that what trains is what reloads runs a twin of the model, built
from its config without weights, on the model's own variables. Every
variable storage created while `autocast` runs is counted (`tf.Variable`s,
which hold Keras variables' values on TensorFlow) and compared with the
model's weight count: a twin built with weights, or one whose variables Keras
initialises when a `StatelessScope` exits, would create as many as the model.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix


@contextlib.contextmanager
def created_elements():
    """Counts the elements of every `tf.Variable` created inside: `counts[0]`."""
    counts = [0]

    def creator(next_creator, **kwargs):
        variable = next_creator(**kwargs)
        counts[0] += int(np.prod(variable.shape))
        return variable

    with tf.variable_creator_scope(creator):
        yield counts


def weight_count(model):
    return sum(int(np.prod(v.shape)) for v in model.weights)


def functional_model():
    inputs = keras.Input((12, 32), name="x")
    h = keras.layers.Dense(64, name="up")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.MultiHeadAttention(2, 16, name="attention")(h, h)
    h = keras.layers.Dense(32, activation="gelu", name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(8, activation="softmax", name="head")(h))


def hub_model():
    keras_hub = pytest.importorskip("keras_hub")
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=1000, num_layers=2, num_heads=2, hidden_dim=64, intermediate_dim=128,
        max_sequence_length=32,
    )


@pytest.mark.parametrize("make", [functional_model, hub_model], ids=["functional", "gpt2"])
@pytest.mark.parametrize("policy", ["O1-bfloat16", "O1-float16"])
def test_autocast_creates_no_copy_of_the_weights(make, policy):
    model = make()
    before = [keras.ops.convert_to_numpy(v) for v in model.weights]
    x = {"token_ids": np.ones((2, 8), "int32"), "padding_mask": np.ones((2, 8), "int32")} if isinstance(
        model.input, dict) else np.ones((2, 12, 32), "float32")
    with created_elements() as created:
        placed = kmix.autocast(model, policy)
        with keras.StatelessScope():  # Keras initialises here what is still listed uninitialised
            pass
    assert placed is model
    # A norm's probe builds a layer or two of the hidden size; a copy would be the whole model.
    assert created[0] <= 0.02 * weight_count(model), (created[0], weight_count(model))
    # The variables are the model's own, untouched: float32 storage, the same values.
    for variable, value in zip(model.weights, before):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), value)
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(keras.ops.cast(keras.tree.flatten(model(x))[0], "float32"))))


def test_a_check_out_of_memory_is_a_warning_and_the_placement_stands(monkeypatch):
    from kmix.placing import twin

    def out_of_memory(rebuilt, model, x):
        raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")

    monkeypatch.setattr(twin, "run", out_of_memory)
    model = functional_model()
    with pytest.warns(UserWarning, match="could not check"):
        placed, table = kmix.autocast(model, "O1-bfloat16", return_table=True)
    assert placed is model
    assert {row.layer: row.after for row in table}["norm"] == "float32"
    assert {row.layer: row.after for row in table}["up"] == "mixed_bfloat16"


@keras.saving.register_keras_serializable(package="kmix_tests")
class ConstantScale(keras.layers.Layer):
    """A layer whose variable starts from an array: Keras cannot make it without storage."""

    def build(self, shape):
        self.scale = keras.Variable(np.linspace(0.5, 1.5, shape[-1]).astype("float32"), name="scale")

    def call(self, x):
        return x * keras.ops.cast(self.scale, x.dtype)


def test_a_model_keras_cannot_build_without_weights_is_still_checked():
    from tests.testing import assert_placement_survives_reload

    inputs = keras.Input((6,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(ConstantScale(name="scale")(
        keras.layers.Dense(6, name="up")(inputs))))
    with keras.StatelessScope(), pytest.raises(ValueError):
        keras.Variable(np.ones(3, "float32"))  # what the weightless twin meets in `build`
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # checked, and nothing to say
        kmix.autocast(model, "O1-bfloat16")
    assert_placement_survives_reload(model, np.ones((2, 6), "float32"))
