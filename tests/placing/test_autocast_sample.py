"""`kmix.autocast(model, level, sample=(x, y))`: placement and initial scale from a diagnosis, in one call.

References: the float32 model (predictions, a `fit` of the same steps),
`kmix.diagnose` run separately (the advised scale), and the plain autocast
copy (non-finite where the sample's copy is not).
"""

import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from tests.testing import full_only

TOLERANCE = 3e-2  # tests/placing/test_real_models.py's float16 tolerance, relative to max |float32 output|


def _overflow_model():
    """x -> Dense "big" (outputs ~1e5, inf in float16) -> Dense "shrink" (back to ~10) -> "mid" -> "head"."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, kernel_initializer=keras.initializers.RandomNormal(stddev=4e4, seed=1),
                           name="big")(inputs)
    h = keras.layers.Dense(8, kernel_initializer=keras.initializers.RandomNormal(stddev=1e-4, seed=2),
                           name="shrink")(h)
    h = keras.layers.Dense(8, name="mid")(h)
    outputs = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inputs, outputs, name="overflow")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def _data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _relative_error(got, want):
    return float(np.abs(np.asarray(got, "float64") - want).max() / np.abs(want).max())


def test_sample_keeps_what_overflows_in_float32_and_advises_the_scale():
    model = _overflow_model()
    x, y = _data()
    expected = model.predict(x, verbose=0)
    assert not np.isfinite(kmix.autocast(model, "O1", copy=True)(x)).all()  # placed without the sample: overflows

    diagnosis = kmix.diagnose(model, x, y, policy="O1", batches=1, batch_size=len(x))  # the float32 model
    assert diagnosis.float32_layers == ["big", "shrink"]
    new, table = kmix.autocast(model, "O1", sample=(x, y), return_table=True)
    assert _relative_error(new(x), expected) < TOLERANCE
    why = {r.layer: (r.after, r.reason) for r in table}
    assert why["big"] == ("float32", "sample: output overflows"), why
    assert why["shrink"] == ("float32", "sample: input overflows"), why  # it would cast 1e5 to half
    assert why["mid"][0] == "mixed_float16"

    with kmix.policy_scope("O1"):
        advised = kmix.wrap(keras.optimizers.Adam(1e-3))
        chosen = kmix.wrap(keras.optimizers.Adam(1e-3), initial_scale=2.0**10)
        unrelated = kmix.wrap(keras.optimizers.Adam(1e-3))
    advised.build(new.trainable_variables)
    chosen.build(new.trainable_variables)
    unrelated.build(_overflow_model().trainable_variables)  # another model: not its advice
    assert diagnosis.recommended_scale != 2.0**15
    assert float(advised.loss_scale) == advised.initial_scale == diagnosis.recommended_scale
    assert float(chosen.loss_scale) == 2.0**10 and float(unrelated.loss_scale) == 2.0**15


def test_sample_as_a_dataset_and_under_float32():
    model = _overflow_model()
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    new = kmix.autocast(model, "O1", sample=dataset)
    assert resolved(new, "big") == "float32" and np.isfinite(new(x)).all()
    # Float32 compute: nothing overflows, nothing is diagnosed (an uncompiled model is fine).
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert resolved(kmix.autocast(plain, "O0", sample=(x, y)), plain.layers[0].name) == "float32"


def resolved(model, name):
    return kmix._tree.resolved_policy(model.get_layer(name)).name


@pytest.mark.parametrize("sample, error, words", [
    (np.zeros((4, 4)), TypeError, "Received: sample=array"),
    ((np.zeros((4, 4)),), TypeError, "of length 1"),
    ((np.zeros((4, 4)), np.zeros((4, 1)), None), TypeError, "of length 3"),
    ((np.zeros((4, 4)), None), ValueError, "sample=(x, None)"),
    ("data", TypeError, "sample='data'"),
])
def test_bad_sample_names_the_argument(sample, error, words):
    model = _overflow_model()
    with pytest.raises(error, match="`sample`") as info:
        kmix.autocast(model, "O1", sample=sample)
    assert words in str(info.value) and "Received" in str(info.value)


def test_sample_needs_a_compiled_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)], name="raw")
    with pytest.raises(ValueError, match="`sample` runs kmix.diagnose.*not compiled"):
        kmix.autocast(model, "O1", sample=_data())


def test_diagnose_float32_layers_are_kept_in_the_half_run():
    model = _overflow_model()
    x, y = _data()
    d = kmix.diagnose(model, x, y, batches=1, batch_size=32, float32_layers=["big", "shrink"])
    assert d.first_nonfinite_layer is None and d.float32_layers == []
    assert all("kept" in r.verdict for r in d.layers if r.path in ("big", "shrink"))
    with pytest.raises(ValueError, match="`float32_layers` names \\['nope'\\]"):
        kmix.diagnose(model, x, y, batches=1, float32_layers=["nope"])
    with pytest.raises(TypeError, match="`float32_layers` must be a list"):
        kmix.diagnose(model, x, y, batches=1, float32_layers=[3])


# ------------------------------------------------------------------------------------ keras-hub T5

SEQ, VOCAB, BATCH, EPOCHS = 8, 32, 8, 6


def _t5_regression():
    """A keras-hub T5Backbone (1 layer, hidden 32, from its constructor) and a Dense head on the decoder."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.T5Backbone(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=32,
                                           intermediate_dim=64, key_value_dim=16, dropout=0.0)
    names = ["encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask"]
    inputs = {name: keras.Input((SEQ,), dtype="int32", name=name) for name in names}
    outputs = keras.layers.Dense(1, name="head")(backbone(inputs)["decoder_sequence_output"])
    model = keras.Model(inputs, outputs, name="t5_regression")
    rng = np.random.default_rng(0)
    ids = lambda: rng.integers(1, VOCAB, (BATCH, SEQ)).astype("int32")  # noqa: E731
    ones = np.ones((BATCH, SEQ), "int32")
    x = {"encoder_token_ids": ids(), "encoder_padding_mask": ones, "decoder_token_ids": ids(),
         "decoder_padding_mask": ones}
    return model, x, rng.normal(size=(BATCH, SEQ, 1)).astype("float32")


@full_only("about 60 s on 2 cores: T5 diagnosed, placed, reloaded and trained beside float32; the sample's route "
           "runs on the smaller models above by default")
def test_t5_trains_under_o1_float16_in_one_call():
    model, x, y = _t5_regression()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    expected = model.predict(x, verbose=0)
    # Without the sample: T5's attention adds a -1e9 mask, -inf in float16; the placed copy is NaN.
    assert not np.isfinite(kmix.autocast(model, "O1", copy=True)(x)).all()
    float32_model = kmix.autocast(model, "O0", copy=True)  # the float32 model, kept beside it
    float32_model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    scale = kmix.diagnose(float32_model, x, y, policy="O1", batches=1, batch_size=BATCH).recommended_scale

    new, table = kmix.autocast(model, "O1", sample=(x, y), return_table=True)
    assert new is model
    assert _relative_error(new(x), expected) < TOLERANCE
    placed = {row.layer.split("/", 1)[1] for row in table if row.reason.startswith("sample: ") and
              "sample: in " not in row.reason}
    assert {"transformer_encoder_layer_0/self_attention", "transformer_decoder_layer_0/cross_attention"} <= placed
    with tempfile.TemporaryDirectory() as tmp:  # the placement is the copy's own: it survives a reload
        path = os.path.join(tmp, "t5.keras")
        new.save(path)
        np.testing.assert_array_equal(keras.models.load_model(path)(x), new(x))

    with kmix.policy_scope("O1"):
        optimizer = kmix.wrap(keras.optimizers.Adam(1e-3))
        new.compile(optimizer=optimizer, loss="mse", jit_compile=False)  # XLA: test_autocast_routes, test_real_models
    history = new.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history["loss"]
    reference = float32_model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history["loss"]

    assert optimizer.initial_scale == scale and int(optimizer.skipped_steps) == 0
    assert np.isfinite(history).all() and history[-1] < 0.6 * history[0], history
    np.testing.assert_allclose(history, reference, rtol=TOLERANCE)
