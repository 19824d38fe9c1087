"""The routes the speed benchmarks compare, each a way a user could make one model faster.

A route is a dtype policy and a stack:

- `keras`: plain Keras, the policy set globally (`float32` is the baseline;
  under `mixed_float16` `compile` wraps Keras's own `LossScaleOptimizer`);
- `kmix`: the policy set globally, kmix's layers (the GPT's attention is
  `kmix.layers.MultiHeadAttention`, float32 softmax) and `kmix.wrap`;
- `keras-again`: the `keras` route built a second time: a control, since
  the same route twice must measure alike within the noise reported;
- `tf-rewrite`: the float32 Keras model under TensorFlow's own grappler
  rewrite (`auto_mixed_precision_onednn_bfloat16` on a CPU,
  `auto_mixed_precision` on a GPU), set only while this route runs;
- `autocast`: the model built in float32, `kmix.autocast(model, "O1-<half>")`
  for the half policy of the row (`mixed_bfloat16` -> `O1-bfloat16`), compiled
  inside `kmix.policy_scope` with `kmix.wrap`: kmix's O1 against Keras's own
  mixed policy on the same model;
- `recommended`: what `kmix.recommend()` picks on this device: the float32
  model (kmix stack), `kmix.autocast(model, rec.policy)`, compiled inside
  `kmix.policy_scope(rec.policy)` with `kmix.wrap` and `rec.jit_compile`;
- `recommend(model)`: the same, with the route `kmix.recommend(model, sample=...)`
  measured on this model's own training step (`recommend_on_model`).

The models: the GPT-style decoder of `kmix.benchmarks.gpt` (`gpt`);
`keras.applications.ResNet50` and `MobileNetV2` (`weights=None`) at a small
input size (`resnet50`, `mobilenetv2`); and, with keras-hub installed, a
keras-hub `GPT2Backbone` with an untied `Dense` LM head (`gpt2-lm`) and a
keras-hub `BertBackbone` classifier on its pooled output (`bert`), built
from constructor arguments (no presets, no download).
"""

import contextlib

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix.benchmarks import gpt
from kmix.benchmarks.common import steady

STACKS = ("keras", "keras-again", "kmix", "tf-rewrite", "autocast", "recommended", "recommend(model)")
PLACED = ("autocast", "recommended", "recommend(model)")  # built in float32 and placed by kmix.autocast
MODELS = ("gpt", "resnet50", "mobilenetv2", "gpt2-lm", "bert")
HUB_MODELS = ("gpt2-lm", "bert")  # need keras-hub
LOGITS = ("gpt", "gpt2-lm", "bert")  # models whose outputs are logits (the loss takes from_logits=True)


def on_gpu():
    """Whether TensorFlow sees a GPU."""
    return bool(tf.config.list_physical_devices("GPU"))


def rewrite_option():
    """The grappler option of TensorFlow's own mixed-precision rewrite on this device."""
    return "auto_mixed_precision" if on_gpu() else "auto_mixed_precision_onednn_bfloat16"


@contextlib.contextmanager
def grappler_rewrite(enabled=True):
    """Turns TensorFlow's mixed-precision graph rewrite on (or off) inside the block.

    The option is read each time a function runs, so functions that run
    outside the block are not rewritten.
    """
    key = rewrite_option()
    previous = tf.config.optimizer.get_experimental_options().get(key, False)
    tf.config.optimizer.set_experimental_options({key: enabled})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({key: previous})


def build(model_name, size, stack):
    """The model under the current dtype policy (uncompiled), its data, and items per batch.

    Args:
        model_name: one of `MODELS`.
        size: for `"gpt"`: `layers`, `d_model`, `heads`, `seq`, `vocab`,
            `batch`; for `"resnet50"`: `image` (side in pixels), `classes`, `batch`.
        stack: `"keras"` or `"kmix"` (which attention the GPT uses).

    Returns:
        `(model, dataset, items)`: a repeated `tf.data.Dataset` of one batch
        of `(x, y)`, and the tokens (GPT) or images (ResNet) per batch.
    """
    if model_name == "gpt":
        model = gpt.build_model(size["layers"], size["d_model"], size["heads"], size["seq"],
                                size["vocab"], stack)
        return model, gpt.make_dataset(size["batch"], size["seq"], size["vocab"]), size["batch"] * size["seq"]
    if model_name == "resnet50":
        keras.utils.set_random_seed(0)
        side = size["image"]
        model = keras.applications.ResNet50(weights=None, input_shape=(side, side, 3), classes=size["classes"])
        return model, _image_data(size), size["batch"]
    if model_name == "mobilenetv2":
        keras.utils.set_random_seed(0)
        side = size["image"]
        model = keras.applications.MobileNetV2(weights=None, input_shape=(side, side, 3), classes=size["classes"])
        return model, _image_data(size), size["batch"]
    if model_name in HUB_MODELS:
        model = _hub_model(model_name, size)
        return model, _token_data(model_name, size), size["batch"] * size["seq"]
    raise ValueError(f"`model_name` must be one of {MODELS}. Received: model_name={model_name!r}")


def _image_data(size):
    rng = np.random.default_rng(0)
    side = size["image"]
    x = rng.uniform(0, 255, size=(size["batch"], side, side, 3)).astype("float32")
    y = rng.integers(0, size["classes"], size=(size["batch"],)).astype("int32")
    return steady(tf.data.Dataset.from_tensors((x, y)).repeat())


def _hub_model(model_name, size):
    """A keras-hub backbone under the current policy, with a head: an untied LM head or a classifier."""
    try:
        import keras_hub
    except ImportError as error:
        raise ImportError(f"`--model {model_name}` needs keras-hub: `pip install keras-hub`.") from error
    keras.utils.set_random_seed(0)
    shape = dict(vocabulary_size=size["vocab"], num_layers=size["layers"], num_heads=size["heads"],
                 hidden_dim=size["d_model"], intermediate_dim=4 * size["d_model"],
                 max_sequence_length=size["seq"], dropout=0.0)
    if model_name == "gpt2-lm":
        backbone = keras_hub.models.GPT2Backbone(**shape)
        logits = keras.layers.Dense(size["vocab"], name="lm_head")(backbone.output)
    else:
        backbone = keras_hub.models.BertBackbone(**shape)
        logits = keras.layers.Dense(size["classes"], name="classifier")(backbone.output["pooled_output"])
    return keras.Model(backbone.input, logits, name=model_name.replace("-", "_"))


def _token_data(model_name, size):
    rng = np.random.default_rng(0)
    batch, seq = size["batch"], size["seq"]
    tokens = rng.integers(0, size["vocab"], size=(batch, seq + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((batch, seq), "int32")}
    if model_name == "gpt2-lm":
        y = tokens[:, 1:]
    else:
        x["segment_ids"] = np.zeros((batch, seq), "int32")
        y = rng.integers(0, size["classes"], size=(batch,)).astype("int32")
    return steady(tf.data.Dataset.from_tensors((x, y)).repeat())


def autocast_policy(policy):
    """The kmix policy of an `autocast` row: `"mixed_<half>"` -> `"O1-<half>"`, float32 as it is."""
    return "O1-" + policy.split("_", 1)[1] if policy.startswith("mixed_") else policy


def recommend_on_model(model_name, size, budget_s, probe=None):
    """`kmix.recommend(model, sample=...)` on the float32 model (kmix stack), as a user would call it.

    The model is compiled as a user's float32 model would be (AdamW, the
    benchmark's loss, Keras's default compile); recommend times copies of it.

    Args:
        model_name, size: see `build`.
        budget_s: `kmix.recommend`'s.
        probe: the `kmix.device.Probe` that picks the half dtypes to time
            (None: `kmix.recommend` measures the default one).

    Returns:
        The `kmix.Recommendation`, with its `table` of routes.
    """
    with kmix.policy_scope("float32"):
        model, data, _ = build(model_name, size, "kmix")
    model.compile(optimizer=keras.optimizers.AdamW(1e-4), loss=loss_for(model_name))
    return kmix.recommend(model, sample=data, budget_s=budget_s, probe=probe)


def loss_for(model_name):
    """The loss the benchmarks train `model_name` with."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=model_name in LOGITS)


class Route:
    """One route, built and compiled, ready to train or predict.

    Args:
        model_name: one of `MODELS`.
        size: see `build`.
        policy: the dtype policy (`"float32"`, `"mixed_bfloat16"`, ...); for
            `"recommended"`, the recommendation's.
        stack: one of `STACKS`.
        jit_compile: passed to `model.compile` (`"auto"`: Keras's default,
            XLA only with a GPU).
    """

    def __init__(self, model_name, size, policy, stack, jit_compile):
        if stack not in STACKS:
            raise ValueError(f"`stack` must be one of {STACKS}. Received: stack={stack!r}")
        self.policy, self.stack = policy, stack
        build_policy = "float32" if stack == "tf-rewrite" or stack in PLACED else policy
        with kmix.policy_scope(build_policy):
            plain = stack in ("keras", "keras-again", "tf-rewrite")
            model, self.data, self.items = build(model_name, size, "keras" if plain else "kmix")
        if stack == "autocast":
            policy = autocast_policy(policy)
            self.policy = policy
        if stack in PLACED:
            model = kmix.autocast(model, policy)
        optimizer = keras.optimizers.AdamW(1e-4)
        with kmix.policy_scope(policy if stack != "tf-rewrite" else "float32"):
            if stack == "kmix" or stack in PLACED:
                optimizer = kmix.wrap(optimizer)
            model.compile(optimizer=optimizer, loss=loss_for(model_name), jit_compile=jit_compile)
        self.model = model
        self.jit_compile = bool(model.jit_compile)
        self.loss = None

    def _context(self):
        return grappler_rewrite() if self.stack == "tf-rewrite" else contextlib.nullcontext()

    def train(self, steps):
        """Trains `steps` steps; keeps the last loss."""
        with self._context():
            history = self.model.fit(self.data, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0)
        self.loss = float(history.history["loss"][-1])

    def predict(self, steps):
        """Runs `predict` over `steps` batches; returns the outputs as float32 NumPy."""
        with self._context():
            out = self.model.predict(self.data.map(lambda x, y: x), steps=steps, verbose=0)
        return np.asarray(out, dtype=np.float32)

    def label(self):
        """`"policy, stack, compilation"`, for progress lines."""
        return f"{self.policy}, {self.stack}, {'XLA' if self.jit_compile else 'tf.function'}"
