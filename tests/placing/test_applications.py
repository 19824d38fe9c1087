"""autocast on every `keras.applications` builder: predictions, the reload invariant, training.

Each builder is built with `weights=None` at the smallest input it accepts,
with 5 classes and no classifier activation (the logits are compared), and
placed under one level (O1, O2 and mixed_bfloat16 rotate over the builders).
The placed model must predict like the float32 model within
half-precision rounding, and be the same model after `.keras` save /
`load_model` (`assert_placement_survives_reload`). With `KMIX_FULL_TESTS=1`
MobileNetV3Small and ResNet50 also train a few steps with `kmix.wrap` (with
`KMIX_ALL_APPLICATIONS=1` EfficientNetB0 too, which has a `Normalization`
layer).

The smallest builder of the cheaper families runs by default; the heads of
the costlier ones (15-45 s each on 2 cores: NASNetMobile, ConvNeXtTiny,
DenseNet121, ...) with `KMIX_FULL_TESTS=1`; the larger siblings (the same
code with more or wider blocks: ResNet152, EfficientNetB7, ConvNeXtXLarge,
...) and InceptionResNetV2 with `KMIX_ALL_APPLICATIONS=1`: each takes 10-50 s
(InceptionResNetV2, 780 layers and 54M parameters at 75x75, 30 s), and all of
them would take the suite far past its 12 minutes.
"""

import os

import keras
import numpy as np
import pytest
from keras import ops

import kmix
from tests.testing import FULL, assert_placement_survives_reload, full_only

LEVELS = ["O1", "O2", "mixed_bfloat16"]
# Worst error of a prediction, relative to the float32 logits' largest |value| (as in test_real_models).
TOLERANCE = {"float16": 3e-2, "bfloat16": 1.2e-1}
# The smallest input side each builder accepts where it is not 32 (found by trying: Keras refuses less).
SMALLEST_INPUT = {"InceptionResNetV2": 75, "InceptionV3": 75, "Xception": 71}
# The builders that run by default: the smallest of each family, MobileNetV3Small and VGG. With
# `KMIX_FULL_TESTS=1` also the family heads that take 15-45 s each on 2 cores (NASNetMobile, built
# inside name scopes; ConvNeXt, DenseNet, EfficientNetV2, InceptionV3, MobileNetV3Large); the
# others are deeper or wider siblings of these.
DEFAULT = {
    "EfficientNetB0", "MobileNet", "MobileNetV2", "MobileNetV3Small", "ResNet50", "ResNet50V2", "VGG16",
    "VGG19", "Xception",
}
if FULL:
    DEFAULT |= {"ConvNeXtTiny", "DenseNet121", "EfficientNetV2B0", "InceptionV3", "MobileNetV3Large",
                "NASNetMobile"}
ALL = os.environ.get("KMIX_ALL_APPLICATIONS") == "1"  # every builder


def builders():
    """Every model builder `keras.applications` exports: its capitalised callables."""
    return sorted(name for name in dir(keras.applications) if name[:1].isupper())


def _matrix():
    """`(builder, level)` for every builder: the default ones first, levels rotating over each group."""
    names = builders()
    ordered = [n for n in names if n in DEFAULT] + [n for n in names if n not in DEFAULT]
    params = []
    for i, name in enumerate(ordered):
        marks = () if name in DEFAULT or ALL else pytest.mark.skip(
            reason="10-50 s on 2 cores (a larger sibling of a default builder); set KMIX_ALL_APPLICATIONS=1"
        )
        params.append(pytest.param(name, LEVELS[i % len(LEVELS)], id=f"{name}-{LEVELS[i % len(LEVELS)]}", marks=marks))
    return params


def _preprocess_input(builder):
    """The `preprocess_input` of the builder's own module (a pass-through where the model has it inside)."""
    for module_name in dir(keras.applications):
        module = getattr(keras.applications, module_name)
        function = getattr(module, "preprocess_input", None)
        if module_name[:1].islower() and function is not None and function.__module__ == builder.__module__:
            return function
    raise LookupError(f"no keras.applications module holds the preprocess_input of {builder.__name__}")


def build(name):
    """The float32 model with healthy batch-norm statistics, an input batch of 2 images, and its logits.

    The logits are those of the calibrating pass (`unit_scale_batch_norms`): each
    batch norm there runs as in inference, on the statistics it has just set.
    """
    builder = getattr(keras.applications, name)
    side = SMALLEST_INPUT.get(name, 32)
    keras.utils.set_random_seed(0)  # the same weights on every run
    model = builder(weights=None, input_shape=(side, side, 3), classes=5, classifier_activation=None)
    images = np.random.default_rng(0).uniform(0.0, 255.0, (2, side, side, 3)).astype("float32")
    x = np.asarray(_preprocess_input(builder)(images.copy()), "float32")
    logits = unit_scale_batch_norms(model, x)
    return model, x, logits


def unit_scale_batch_norms(model, x):
    """Sets each `BatchNormalization`'s statistics so that its output on `x` has unit RMS.

    With `weights=None` and batch-norm statistics at mean 0, variance 1,
    activations shrink layer after layer: MobileNet's logits are 1e-21 in
    float32, below float16's smallest subnormal number, where no
    half-precision model can follow them. Trained models keep their
    activations near unit scale through their statistics; one inference pass
    sets these ones to do the same. One variance per layer, not per channel:
    a per-channel variance of 2 images would divide near-constant channels by
    ~0 and amplify rounding without bound. `gamma` is left alone, so training
    (which normalizes by the batch's own statistics) is unchanged.

    Returns:
        The model's outputs on `x` in that pass: those of inference on the new statistics.
    """
    call = keras.layers.BatchNormalization.call

    def calibrating_call(self, inputs, training=None, mask=None):
        mean_square = ops.mean(ops.square(ops.cast(inputs, "float32")))
        self.moving_mean.assign(ops.zeros_like(self.moving_mean))
        variance = ops.maximum(mean_square - self.epsilon, 0.0)
        self.moving_variance.assign(ops.full_like(self.moving_variance, variance))
        return call(self, inputs, training=False, mask=mask)

    keras.layers.BatchNormalization.call = calibrating_call
    try:
        return model(x, training=False)
    finally:
        keras.layers.BatchNormalization.call = call


def _numpy(outputs):
    return ops.convert_to_numpy(outputs).astype("float64")


def _keras_own_error(name, model, x, expected, compute_dtype):
    """The error of Keras's own mixed policy (every layer half) with the same weights."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(f"mixed_{compute_dtype}")
    try:
        side = x.shape[1]
        plain = getattr(keras.applications, name)(
            weights=None, input_shape=(side, side, 3), classes=5, classifier_activation=None
        )
    finally:
        keras.config.set_dtype_policy(previous)
    plain.set_weights(model.get_weights())
    return np.abs(_numpy(plain(x, training=False)) - expected).max()


def test_the_matrix_holds_every_builder():
    names = builders()
    assert len(names) >= 40 and DEFAULT <= set(names), sorted(DEFAULT - set(names))
    levels = {}
    for param in _matrix():
        levels.setdefault(param.values[1], []).append(param.values[0])
    assert sorted(n for group in levels.values() for n in group) == names
    assert all(len([n for n in levels[level] if n in DEFAULT]) >= 3 for level in LEVELS), levels


@pytest.mark.parametrize("name, level", _matrix())
def test_autocast_application(name, level):
    """Placed in place, it predicts like the float32 model and is the same after a reload."""
    model, x, logits = build(name)
    expected = _numpy(logits)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 1e-3  # a signal half can carry

    new = kmix.autocast(model, level)
    assert new is model
    outputs = new(x, training=False)
    policy = kmix.Policy(level)
    if policy.output_dtype == "float32":  # under a Keras name (mixed_bfloat16) the model's layers decide
        assert keras.backend.standardize_dtype(outputs.dtype) == "float32"
    got = _numpy(outputs)
    assert np.isfinite(got).all(), f"{name} {level}: the copy predicts {got}"
    compute_dtype = policy.compute_dtype
    error = np.abs(got - expected).max()
    bound = TOLERANCE[compute_dtype] * np.abs(expected).max()
    if error > bound:
        # Deep untrained networks (EfficientNetB1 and up) amplify half rounding past the
        # tolerance whatever the placement: the copy must then be no worse than Keras's own
        # mixed policy, which computes every layer (normalizations included) in half.
        keras_error = _keras_own_error(name, model, x, expected, compute_dtype)
        assert error <= 1.1 * keras_error, (
            f"{name} {level}: error {error / np.abs(expected).max():.2e} of the largest logit "
            f"(tolerance {TOLERANCE[compute_dtype]:.0e}; Keras's own mixed_{compute_dtype}: "
            f"{keras_error / np.abs(expected).max():.2e})"
        )
    assert_placement_survives_reload(new, x, outputs=outputs)


# One residual network, one mobile one, one with a Normalization layer (EfficientNetB0's input
# normalization). Under float16 the first steps of these fresh networks overflow and are skipped:
# with 2 images a batch, the deep layers' batch statistics (2 values a channel at 1x1) make even
# float32 weight gradients reach 1e9 (ResNet50's conv1 kernel; MobileNetV3Small's 80 is 2.6e6 at
# the first scale, 2^15). There the test checks that a skipped step changed nothing.
# ResNet50 by default; the other two (O2's half variables, a Normalization layer) with
# KMIX_ALL_APPLICATIONS=1 (12-21 s each on 2 cores; O2 training is also in test_real_models).
# Training: MobileNetV3Small (a mobile network with hard-swish and squeeze-excite) and ResNet50
# (90 s) with KMIX_FULL_TESTS=1, EfficientNetB0 (a `Normalization` layer) with KMIX_ALL_APPLICATIONS=1.
TRAIN = ([pytest.param("MobileNetV3Small", "O2", marks=full_only("about 50 s on 2 cores; O2 trains on "
                                                                 "keras-hub models in test_real_models"))]
         + ([("ResNet50", "mixed_bfloat16")] if FULL or ALL else [])
         + ([("EfficientNetB0", "O1")] if ALL else []))
STEPS = 4  # on one batch; a tf.function trace of the train step is most of the time (15-25 s)


@pytest.mark.parametrize("name, level", TRAIN)
def test_autocast_application_trains(name, level):
    """A few `fit` steps (tf.function, no XLA) with `kmix.wrap` on one batch: the loss scaling's bookkeeping.

    Whether the loss of an untrained deep network falls within four steps in
    half precision depends on the CPU's kernels (ResNet50 in bfloat16 rose on
    an AVX2-only EPYC): the test compares the placed model's loss with the
    float32 model's instead, and checks what each step did.
    """
    model, x, _ = build(name)
    y = np.array([1, 3])
    if name == "EfficientNetB0":
        assert any(isinstance(layer, keras.layers.Normalization) for layer in model.layers)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = float(loss(y, model(x, training=False)))
    new = kmix.autocast(model, level)
    assert new is model
    tolerance = 0.1 if kmix.Policy(level).compute_dtype == "bfloat16" else 0.03
    assert abs(float(loss(y, new(x, training=False))) - reference) <= tolerance * max(1.0, abs(reference))
    with kmix.policy_scope(level):
        optimizer = kmix.wrap(keras.optimizers.Adam(1e-4))
        new.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    optimizer.build(new.trainable_variables)  # built before fit: one trace of the train step, not two
    before = {id(v): ops.convert_to_numpy(v).copy() for v in new.weights}
    # One step an epoch: each epoch's loss is that of the weights the step before left.
    history = new.fit(x, y, batch_size=len(x), epochs=STEPS, shuffle=False, verbose=0).history["loss"]
    skipped = int(optimizer.skipped_steps)
    assert int(optimizer.iterations) + skipped == STEPS, (int(optimizer.iterations), skipped)
    scaled = kmix.Policy(level).needs_loss_scaling
    assert float(optimizer.loss_scale) == (2.0**15 / 2**skipped if scaled else 1.0)
    assert np.isfinite(history).all(), (history, skipped)
    if not scaled:  # bfloat16: no overflow, every step is applied
        assert skipped == 0, (history, skipped)
    if skipped == STEPS:  # a skipped step changes nothing, batch-norm statistics included
        for variable in new.weights:
            np.testing.assert_array_equal(ops.convert_to_numpy(variable), before[id(variable)], err_msg=variable.path)
    else:
        assert any(not np.array_equal(ops.convert_to_numpy(v), before[id(v)]) for v in new.trainable_weights)
    assert_placement_survives_reload(new, x)
