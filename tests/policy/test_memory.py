"""kmix.memory_report: the textbook case, and a model's counts against hand-computed ones."""

import keras
import numpy as np
import pytest

import kmix
from kmix.policy import Policy, memory_report

GB = 1e9


def test_textbook_8b_bf16_adam_is_128_gb():
    report = memory_report(8e9, Policy("O2", half="bfloat16"), "adam")
    row = report["O2-bfloat16"]
    assert (row["params"], row["master_weights"], row["grads"], row["optimizer_slots"]) == (
        16 * GB, 32 * GB, 16 * GB, 64 * GB,
    )
    assert row["activations"] is None
    assert row["total"] == 128 * GB
    assert "128.0 GB" in str(report) and "O2-bfloat16" in str(report)


def small_model():
    return keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32), keras.layers.BatchNormalization(), keras.layers.Dense(4)]
    )


def test_every_opt_level_against_hand_counts():
    model = small_model()
    trainable = 16 * 32 + 32 + 2 * 32 + 32 * 4 + 4
    frozen = 2 * 32  # batch-norm moving mean and variance
    assert model.count_params() == trainable + frozen
    report = memory_report(model, optimizer="adam", batch_size=8)
    assert list(report) == ["O0", "O1-float16", "O2-float16", "O3-float16"]
    acts = 8 * (32 + 32 + 4)  # every layer's output, per sample, times the batch
    # bytes: params, masters, grads, slots (Adam: 2 per parameter), activations
    hand = {
        "O0": (4 * (trainable + frozen), 0, 4 * trainable, 8 * trainable, 4 * acts),
        "O1-float16": (4 * (trainable + frozen), 0, 4 * trainable, 8 * trainable, 2 * acts),
        "O2-float16": (2 * (trainable + frozen), 4 * trainable, 2 * trainable, 8 * trainable, 2 * acts),
        "O3-float16": (2 * (trainable + frozen), 0, 2 * trainable, 4 * trainable, 2 * acts),
    }
    for name, parts in hand.items():
        row = report[name]
        got = tuple(row[k] for k in ("params", "master_weights", "grads", "optimizer_slots", "activations"))
        assert got == parts, name
        assert row["total"] == sum(parts)


@pytest.mark.parametrize(
    "optimizer",
    [
        keras.optimizers.SGD(),
        keras.optimizers.SGD(momentum=0.9),
        keras.optimizers.Adam(),
        keras.optimizers.AdamW(amsgrad=True),
        keras.optimizers.RMSprop(centered=True),
        keras.optimizers.Lion(),
    ],
    ids=["sgd", "momentum", "adam", "amsgrad", "rmsprop-centered", "lion"],
)
def test_slots_match_a_real_build(optimizer):
    model = small_model()
    report = memory_report(model, "O0", kmix.wrap(optimizer))
    # Another way: build a copy of the optimizer on the model's own variables and count.
    real = type(optimizer).from_config(optimizer.get_config())
    real.build(model.trainable_variables)
    elements = sum(int(np.prod(v.shape)) for v in real.variables if len(v.shape) > 0)
    assert report["O0"]["optimizer_slots"] == 4 * elements
    assert report.slots_per_param == elements / report.num_params


def test_attention_scores_are_part_of_the_estimate():
    inputs = keras.Input((5, 8))
    model = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 4)(inputs, inputs))
    report = memory_report(model, "O0", optimizer=None, batch_size=3)
    assert report["O0"]["activations"] == 4 * 3 * (5 * 8 + 2 * 2 * 5 * 5)
    assert report["O0"]["optimizer_slots"] == 0


def test_slot_count_and_unknown_activations():
    report = memory_report(small_model(), ["O1", "float16"], optimizer=3)
    assert report.slots_per_param == 3
    assert report["float16"]["activations"] is None  # no batch size
    variable_length = keras.Sequential([keras.Input((None, 4)), keras.layers.Dense(2)])
    assert memory_report(variable_length, "O0", batch_size=2)["O0"]["activations"] is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="not built"):
        memory_report(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(TypeError, match="model="):
        memory_report("big")
    with pytest.raises(ValueError, match="batch_size=0"):
        memory_report(small_model(), batch_size=0)
    with pytest.raises(ValueError, match="'nadamw'"):
        memory_report(10, optimizer="nadamw")
    with pytest.raises(ValueError, match="'O5'"):
        memory_report(10, "O5")
