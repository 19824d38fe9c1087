"""autocast on models nobody on this team wrote: keras-hub BERT and GPT-2, keras.ops graphs, a BN CNN.

Each model is built tiny from constructor arguments (no presets, no downloads;
the keras-hub ones with one block: a second repeats the first's placement),
placed under O1, O2 and mixed_bfloat16, and compared with its float32 self:
same predictions within half-precision rounding, float32 batch norm under O2,
outputs in the policy's output dtype, a few XLA-compiled `fit` steps with
`kmix.wrap` that lower the loss, and the reload invariant: in memory and after
`.keras` save / `load_model`, the same predictions bit for bit and the same placement.
"""

import os
import tempfile
import warnings

import keras
import numpy as np
import pytest

import kmix
from tests.testing import assert_placement_survives_reload, full_only, placement_listing

keras_hub = pytest.importorskip("keras_hub")

SEQ, VOCAB, BATCH = 12, 40, 8
# Worst error of a prediction, relative to the float32 output's largest value.
TOLERANCE = {"float16": 3e-2, "bfloat16": 1.2e-1}
LEVELS = ["O1", "O2", "mixed_bfloat16"]


def _token_inputs(rng, padding=True):
    lengths = rng.integers(SEQ // 2, SEQ + 1, (BATCH, 1)) if padding else np.full((BATCH, 1), SEQ)
    return {
        "token_ids": rng.integers(1, VOCAB, (BATCH, SEQ)).astype("int32"),
        "padding_mask": (np.arange(SEQ)[None] < lengths).astype("int32"),
    }


def bert_classifier(rng):
    """BertBackbone (given a policy map as dtype) with BERT-style `h[:, 0, :]` pooling and a head."""
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=SEQ, dtype=keras.dtype_policies.DTypePolicyMap(default_policy="float32"),
    )
    inputs = {
        "token_ids": keras.Input((SEQ,), dtype="int32", name="token_ids"),
        "segment_ids": keras.Input((SEQ,), dtype="int32", name="segment_ids"),
        "padding_mask": keras.Input((SEQ,), dtype="int32", name="padding_mask"),
    }
    sequence = backbone(inputs)["sequence_output"]
    logits = keras.layers.Dense(3, name="classifier")(sequence[:, 0, :])
    x = dict(_token_inputs(rng), segment_ids=np.zeros((BATCH, SEQ), "int32"))
    y = rng.integers(0, 3, (BATCH,))
    return keras.Model(inputs, logits, name="bert_classifier"), x, y


def gpt2_lm(rng):
    """keras-hub's GPT2CausalLM (a task: a functional subclass) without a preprocessor."""
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=32, intermediate_dim=64,
        max_sequence_length=SEQ,
    )
    x = _token_inputs(rng, padding=False)
    y = np.roll(x["token_ids"], -1, axis=1)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None), x, y


def mean_pool(rng):
    """A functional graph of keras.ops nodes: mean, reshape, arithmetic between tensors, a slice."""
    inputs = keras.Input((SEQ, 8), name="x")
    h = keras.layers.Dense(16, activation="relu", name="proj")(inputs)
    h = keras.layers.LayerNormalization(name="norm")(h)
    pooled = keras.ops.mean(h, axis=1) * 0.5 + h[:, 0, :]
    pooled = keras.ops.reshape(pooled, (-1, 4, 4))
    logits = keras.layers.Dense(3, name="logits")(keras.layers.Flatten(name="flat")(pooled))
    x = rng.normal(size=(BATCH, SEQ, 8)).astype("float32")
    return keras.Model(inputs, logits, name="mean_pool"), x, rng.integers(0, 3, (BATCH,))


def cnn_bn(rng):
    """A small CNN with batch normalization (Sequential)."""
    model = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(8, 3, padding="same", name="conv"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.ReLU(name="relu"),
            keras.layers.GlobalAveragePooling2D(name="pool"),
            keras.layers.Dense(3, name="logits"),
        ],
        name="cnn_bn",
    )
    x = rng.normal(size=(BATCH, 8, 8, 3)).astype("float32")
    return model, x, rng.integers(0, 3, (BATCH,))


MODELS = {"bert": bert_classifier, "gpt2": gpt2_lm, "mean_pool": mean_pool, "cnn_bn": cnn_bn}


def _numpy(outputs):
    return keras.ops.convert_to_numpy(outputs).astype("float64")


def _dtypes(model):
    """Each weight's dtype, in order (a Sequential built from `keras.Input` prefixes its paths)."""
    return [(v.path.split("/")[-1], str(v.dtype)) for v in model.weights]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_autocast_real_model(name, level):
    rng = np.random.default_rng(0)
    model, x, y = MODELS[name](rng)
    policy = kmix.Policy(level)
    expected = _numpy(model(x, training=False))
    weights = [(v, _numpy(v)) for v in model.weights]

    new = kmix.autocast(model, level)
    assert new is model  # placed in place: the same object and variables

    # Predicts like the float32 model within half rounding, outputs in the policy's dtype.
    got = new(x, training=False)
    if policy.output_dtype == "float32":  # under a Keras name the model's own layers decide
        assert keras.backend.standardize_dtype(got.dtype) == "float32"
    tolerance = TOLERANCE[policy.compute_dtype] * np.abs(expected).max()
    np.testing.assert_allclose(_numpy(got), expected, atol=tolerance, rtol=0)

    # Parameters in the policy's dtype, but normalization (batch-norm statistics included) and
    # the layer producing the output in float32 when outputs are, where it cannot hand float32 out
    # from a half matmul (GPT-2's tied embedding; a Dense head computes in half, float32 out).
    output_layers = ("token_embedding",) if name == "gpt2" else ()
    for variable in new.weights:
        if "norm" in variable.path or "bn" in variable.path.split("/"):
            assert variable.dtype == "float32", variable.path
        elif variable.path.split("/")[-2] in output_layers or variable.path.split("/")[0] in output_layers:
            want = "float32" if policy.output_dtype == "float32" else policy.params_dtype
            assert variable.dtype == want, (variable.path, variable.dtype)
        else:
            assert variable.dtype == policy.params_dtype, (variable.path, variable.dtype)

    # The same variables, their values cast, and an exact round trip through .keras.
    assert [v for v, _ in weights] == list(new.weights)
    for variable, value in weights:
        np.testing.assert_array_equal(_numpy(variable), value.astype(variable.dtype).astype("float64"))
    loaded = assert_placement_survives_reload(new, x, outputs=got)
    assert _dtypes(loaded) == _dtypes(new)


# XLA compiles of the keras-hub models take 10-30 s each on a 2-core CPU: they train under O2
# (half parameters, float32 master weights, dynamic scale), the other levels on the small models.
# BERT's (15 s) runs with KMIX_FULL_TESTS=1: GPT-2's covers a keras-hub model under XLA by default.
TRAIN = [pytest.param(name, "O2", marks=full_only("an XLA compile of 15 s on 2 cores") if name == "bert" else ())
         for name in sorted(MODELS)] + [
    (name, "O1") for name in ("cnn_bn", "mean_pool")
] + [pytest.param(name, "mixed_bfloat16", marks=full_only("an XLA compile, 3-5 s on 2 cores"))
     for name in ("cnn_bn", "mean_pool")]


@pytest.mark.parametrize("name, level", TRAIN)
def test_autocast_real_model_trains_with_xla(name, level):
    """A few XLA-compiled `fit` steps with `kmix.wrap` lower the loss; skipped steps back the scale off.

    The optimizer is built before `fit`, as Keras builds it under a distribution
    strategy: built in the first trace instead, a loss scale's counters make
    TensorFlow trace and compile the step twice (that route, the default one, is
    tests/placing/test_autocast_routes.py's subclassed model under XLA).
    """
    rng = np.random.default_rng(1)
    model, x, y = MODELS[name](rng)
    new = kmix.autocast(model, level)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with kmix.policy_scope(level):
        optimizer = kmix.wrap(keras.optimizers.Adam(5e-3))
        new.compile(optimizer=optimizer, loss=loss_fn, jit_compile=True)
    optimizer.build(new.trainable_variables)
    before = float(loss_fn(y, new(x, training=False)))
    history = new.fit(x, y, batch_size=BATCH, epochs=5, shuffle=False, verbose=0).history["loss"]
    after = float(loss_fn(y, new(x, training=False)))
    assert np.isfinite(history).all() and after < before, (before, after, history)
    # Float16 gradients of a fresh model may overflow at the first scale (2^15): each skipped
    # step halves it; the others are applied.
    skipped = int(optimizer.skipped_steps)
    assert int(optimizer.iterations) + skipped == 5 and skipped < 5
    expected_scale = 2.0**15 / 2**skipped if kmix.Policy(level).needs_loss_scaling else 1.0
    assert float(optimizer.loss_scale) == expected_scale
    if level == "O2":  # the half parameters follow their float32 master copies
        assert optimizer.master_weights and any(v.dtype == "float16" for v in new.trainable_weights)
    assert_placement_survives_reload(new, x)  # trained (moved batch-norm statistics included)


def _tokens(rng):
    return {"token_ids": rng.integers(1, VOCAB, (2, SEQ)).astype("int32"),
            "padding_mask": np.ones((2, SEQ), "int32")}


BACKBONES = {
    "DistilBertBackbone": (dict(vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
                                intermediate_dim=32, max_sequence_length=SEQ), _tokens),
    "GemmaBackbone": (dict(vocabulary_size=VOCAB, num_layers=1, num_query_heads=2, num_key_value_heads=1,
                           hidden_dim=16, intermediate_dim=32, head_dim=8), _tokens),
    "LlamaBackbone": (dict(vocabulary_size=VOCAB, num_layers=1, num_query_heads=2, num_key_value_heads=1,
                           hidden_dim=16, intermediate_dim=32), _tokens),
    "ViTBackbone": (dict(image_shape=(16, 16, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=16,
                         mlp_dim=32), lambda rng: rng.normal(size=(2, 16, 16, 3)).astype("float32")),
}


@pytest.mark.parametrize("cls_name", sorted(BACKBONES))
def test_keras_hub_backbones_in_general(cls_name):
    """Other keras-hub families (their own norms, rotary embeddings, float32 softmax) under O2."""
    kwargs, make_x = BACKBONES[cls_name]
    model = getattr(keras_hub.models, cls_name)(**kwargs)
    x = make_x(np.random.default_rng(0))
    new, table = kmix.autocast(model, "O2", return_table=True)
    assert type(new) is type(model)
    # Normalization parameters (keras-hub's LlamaLayerNorm, RMS norms, ...) float32, matmuls half.
    norms = [row.layer for row in table if "normalization" in row.reason]
    assert norms and all(v.dtype == "float32" for v in new.weights if "norm" in v.path)
    assert any(v.dtype == "float16" for v in new.weights if v.path.endswith("kernel"))
    expected = keras.tree.flatten(model(x, training=False))
    outputs = new(x, training=False)
    for e, g in zip(expected, keras.tree.flatten(outputs)):
        e, g = _numpy(e), _numpy(g)
        np.testing.assert_allclose(g, e, atol=TOLERANCE["float16"] * np.abs(e).max(), rtol=0)
    assert_placement_survives_reload(new, x, outputs=outputs)


@pytest.mark.parametrize("level", LEVELS)
def test_keras_hub_image_classifier_whose_reload_cannot_be_placed(level):
    """keras-hub's DenseNet ImageClassifier: placed in memory; what a reload cannot place is named.

    DenseNetBackbone builds its layers under the global policy, not its
    `dtype`, and its config holds only constructor arguments: `load_model`
    builds them under the global policy of the moment. autocast places the
    model in memory and warns, naming the layers; `kmix.autocast` of the
    reloaded model places it again, exactly as before the save.
    """
    backbone = keras_hub.models.DenseNetBackbone(
        stackwise_num_repeats=[1, 1], image_shape=(32, 32, 3), growth_rate=4
    )
    model = keras_hub.models.DenseNetImageClassifier(backbone=backbone, num_classes=5)
    x = np.random.default_rng(0).uniform(0.0, 1.0, (2, 32, 32, 3)).astype("float32")
    expected = _numpy(model(x, training=False))
    policy = kmix.Policy(level)

    with pytest.warns(UserWarning, match="load_model` would place .*conv1_conv"):
        new, table = kmix.autocast(model, level, return_table=True)
    assert new is model
    conv = {row.layer: row for row in table}["dense_net_backbone/conv1_conv"]
    assert conv.after == policy.to_keras().name and "a reload gives Conv2D float32" in conv.reason, conv
    listing = placement_listing(new)
    convs = {path: row for path, row in listing.items() if row[0] == "Conv2D"}
    assert convs and all(row[1] == policy.compute_dtype for row in convs.values()), convs
    norms = {path: row for path, row in listing.items() if row[0] == "BatchNormalization"}
    assert norms and all(set(row[3]) == {"float32"} for row in norms.values()), norms
    got = new(x, training=False)
    tolerance = TOLERANCE[policy.compute_dtype] * np.abs(expected).max()
    np.testing.assert_allclose(_numpy(got), expected, atol=tolerance, rtol=0)

    with tempfile.TemporaryDirectory() as tmp:  # the documented way back: autocast the reloaded model
        path = os.path.join(tmp, "densenet.keras")
        new.save(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = kmix.autocast(keras.models.load_model(path), level)
    assert placement_listing(again) == listing
    np.testing.assert_array_equal(_numpy(again(x, training=False)), _numpy(got))
