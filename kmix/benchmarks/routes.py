"""The routes the speed benchmarks compare: a dtype policy and a stack (`STACKS`) on one of `MODELS`."""

import contextlib

import keras
import numpy as np
import tensorflow as tf

import kmix
from kmix.benchmarks import gpt
from kmix.benchmarks.common import gpu_device, progress, steady, token_batch
from kmix.route import timing

STACKS = ("keras", "keras-again", "kmix", "tf-rewrite", "autocast", "recommended", "recommend(model)")
PLACED = ("autocast", "recommended", "recommend(model)")  # built in float32 and placed by kmix.autocast
MODELS = ("gpt", "resnet50", "mobilenetv2", "gpt2-lm", "bert")
HUB_MODELS = ("gpt2-lm", "bert")  # need keras-hub
LOGITS = ("gpt", "gpt2-lm", "bert")  # models whose outputs are logits (the loss takes from_logits=True)


def rewrite_option():
    """The grappler option of TensorFlow's own mixed-precision rewrite on this device."""
    return "auto_mixed_precision" if gpu_device() else "auto_mixed_precision_onednn_bfloat16"


@contextlib.contextmanager
def grappler_rewrite(enabled=True):
    """TensorFlow's mixed-precision graph rewrite on (or off) inside the block; read each time a function runs."""
    key = rewrite_option()
    previous = tf.config.optimizer.get_experimental_options().get(key, False)
    tf.config.optimizer.set_experimental_options({key: enabled})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({key: previous})


def build(model_name, size, stack):
    """`(model, dataset, items per batch)`: `model_name` uncompiled under the current policy, one batch repeated."""
    if model_name == "gpt":
        model = gpt.build_model(size["layers"], size["d_model"], size["heads"], size["seq"], size["vocab"], stack)
        return model, gpt.make_dataset(size["batch"], size["seq"], size["vocab"]), size["batch"] * size["seq"]
    if model_name in ("resnet50", "mobilenetv2"):
        keras.utils.set_random_seed(0)
        application = keras.applications.ResNet50 if model_name == "resnet50" else keras.applications.MobileNetV2
        model = application(weights=None, input_shape=(size["image"], size["image"], 3), classes=size["classes"])
        return model, _image_data(size), size["batch"]
    if model_name in HUB_MODELS:
        return _hub_model(model_name, size), _token_data(model_name, size), size["batch"] * size["seq"]
    raise ValueError(f"`model_name` must be one of {MODELS}. Received: model_name={model_name!r}")


def _image_data(size):
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, size=(size["batch"], size["image"], size["image"], 3)).astype("float32")
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
    x, y = token_batch(rng, size["vocab"], size["batch"], size["seq"])
    if model_name == "bert":
        x["segment_ids"] = np.zeros_like(y)
        y = rng.integers(0, size["classes"], size=(size["batch"],)).astype("int32")
    return steady(tf.data.Dataset.from_tensors((x, y)).repeat())


def recommend_on_model(model_name, size, budget_s, probe=None):
    """`kmix.recommend(model, sample=..., budget_s=..., probe=...)` on the float32 model, compiled as a user would."""
    progress(f"kmix.recommend(model, ...): timing this model's own step on each route (budget_s={budget_s:g})")
    with kmix.policy_scope("float32"):
        model, data, _ = build(model_name, size, "kmix")
    model.compile(optimizer=keras.optimizers.AdamW(1e-4), loss=loss_for(model_name))
    return kmix.recommend(model, sample=data, budget_s=budget_s, probe=probe)


def loss_for(model_name):
    """The loss the benchmarks train `model_name` with."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=model_name in LOGITS)


class Route:
    """One route, built and compiled: a model of `MODELS`, a policy, a stack of `STACKS` and a `jit_compile`."""

    def __init__(self, model_name, size, policy, stack, jit_compile):
        if stack not in STACKS:
            raise ValueError(f"`stack` must be one of {STACKS}. Received: stack={stack!r}")
        self.model_name, self.size, self.policy, self.stack, self.loss = model_name, size, policy, stack, None
        kmix_stack = stack in ("kmix", *PLACED)  # kmix's attention and kmix.wrap's optimizer
        with kmix.policy_scope("float32" if stack == "tf-rewrite" or stack in PLACED else policy):
            model, self.data, self.items = build(model_name, size, "kmix" if kmix_stack else "keras")
        if stack == "autocast":  # "mixed_<half>" -> "O1-<half>"
            policy = self.policy = "O1-" + policy.split("_", 1)[1] if policy.startswith("mixed_") else policy
        model = kmix.autocast(model, policy) if stack in PLACED else model
        with kmix.policy_scope(policy if stack != "tf-rewrite" else "float32"):
            optimizer = kmix.wrap(keras.optimizers.AdamW(1e-4)) if kmix_stack else keras.optimizers.AdamW(1e-4)
            model.compile(optimizer=optimizer, loss=loss_for(model_name), jit_compile=jit_compile)
        self.model, self.jit_compile = model, bool(model.jit_compile)

    def _context(self):
        return grappler_rewrite() if self.stack == "tf-rewrite" else contextlib.nullcontext()

    def train(self, steps):
        """Trains `steps` steps; keeps the last loss."""
        with self._context():
            if not self.model.optimizer.built:  # here, not in fit: a first step that builds it traces twice
                self.model.optimizer.build(self.model.trainable_variables)
            history = self.model.fit(self.data, steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0)
        self.loss = float(history.history["loss"][-1])

    def figures(self, rounds, peak_bytes):
        """The route's figures from its `rounds` (seconds per step): the median step, items/s, model TFLOP/s (GPT)."""
        step, s = timing.median(rounds), self.size
        tflops = (gpt.model_flops_per_token(self.model, s["layers"], s["d_model"], s["seq"]) * self.items / step / 1e12
                  if self.model_name == "gpt" else None)
        return {"policy": self.policy, "stack": self.stack, "jit_compile": self.jit_compile, "step_seconds": step,
                "tokens_per_second": self.items / step, "tflops": tflops, "peak_bytes": peak_bytes, "loss": self.loss,
                "rounds": tuple(rounds)}

    def predict(self, steps):
        """Runs `predict` over `steps` batches; returns the outputs as float32 NumPy."""
        with self._context():
            return np.asarray(self.model.predict(self.data.map(lambda x, y: x), steps=steps, verbose=0), np.float32)
