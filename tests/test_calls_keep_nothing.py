"""kmix's calls keep nothing alive once they return: no traced graph held by TensorFlow's gradient registry.

Keras's `silu` on TensorFlow is a `tf.custom_gradient`: every trace of a model using it
(Llama, Qwen, Gemma...) registers a gradient function that holds the traced graph for the
life of the process. kmix's own traces end with its calls; the reference is the registry's
size before the call (a plain Keras `predict` trace, which outlives the call, adds entries).
`kmix.export`'s traces are checked so on every causal LM tests/serving/test_export_hub_lm.py exports.
"""

import gc
import types

import keras
import numpy as np
import pytest
from tensorflow.python.framework import ops

import kmix
from tests.route.fakes import FAKE_PROBE
from tests.testing import created_variables

keras_hub = pytest.importorskip("keras_hub")


def _registered():
    gc.collect()
    return {name for name in ops.gradient_registry._registry if name.startswith("CustomGradient-")}


def _silu_lm():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Qwen2Backbone(vocabulary_size=64, num_layers=1, num_query_heads=2,
                                              num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)
    backbone.enable_lora(rank=2)
    lm = keras_hub.models.Qwen2CausalLM(backbone=backbone, preprocessor=None)
    x = {"token_ids": np.ones((2, 8), "int32"), "padding_mask": np.ones((2, 8), "int32")}
    return lm, x


@pytest.fixture(scope="module")
def calls():
    """A Qwen2 causal LM (silu) with LoRA: Keras's `predict`, then `kmix.autocast` and `kmix.recommend` on it;
    what Keras's trace and kmix's calls left in the gradient registry, and the variables autocast created."""
    lm, x = _silu_lm()
    before = _registered()
    lm.predict(x, verbose=0)
    after_keras = _registered()
    weights = sum(int(np.prod(v.shape)) for v in lm.weights)

    with created_variables() as created:
        kmix.autocast(lm, "O1-bfloat16")
    # A given probe and float32 alone: no device probe, so the budget goes to building the float32 route on
    # the model (its training step traced: silu's gradients registered), and too little is left for XLA's.
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rec = kmix.recommend(lm, x, x["token_ids"], loss=loss, batch_size=2, dtypes=("float32",), budget_s=8,
                         probe=FAKE_PROBE, verbose=False)
    return types.SimpleNamespace(keras_left=after_keras - before, kmix_left=_registered() - after_keras, rec=rec,
                                 created=sum(int(np.prod(v.shape)) for v in created), weights=weights)


def test_a_keras_trace_registers_gradients_and_kmix_calls_leave_none(calls):
    assert len(calls.keras_left) > 0  # the leak kmix works around: Keras's own trace registers some
    timed = [(r.policy, r.jit_compile) for r in calls.rec.table.routes] if calls.rec.table else []
    assert ("float32", False) in timed, calls.rec  # recommend traced the model's training step
    assert calls.kmix_left == set()


def test_autocast_of_a_keras_hub_task_creates_no_weights(calls):
    """A keras-hub task compiles itself in its constructor: its twin is still built without weights."""
    # About 3.5k weights, the largest matrix 1k: a copy of any matrix but LoRA's (16 x 2) is over the bound.
    assert calls.created < 0.05 * calls.weights, (calls.created, calls.weights)
