"""kmix's calls keep nothing alive once they return: no traced graph held by TensorFlow's gradient registry.

Keras's `silu` on TensorFlow is a `tf.custom_gradient`: every trace of a model using it
(Llama, Qwen, Gemma...) registers a gradient function that holds the traced graph for the
life of the process. kmix's own traces end with its calls; the reference is the registry's
size before the call (a plain Keras `predict` trace, which outlives the call, adds entries).
"""

import gc

import keras
import numpy as np
import pytest
from tensorflow.python.framework import ops

import kmix

keras_hub = pytest.importorskip("keras_hub")


def _registered():
    gc.collect()
    return {name for name in ops.gradient_registry._registry if name.startswith("CustomGradient-")}


def _silu_lm():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Qwen2Backbone(vocabulary_size=64, num_layers=2, num_query_heads=2,
                                              num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)
    backbone.enable_lora(rank=2)
    lm = keras_hub.models.Qwen2CausalLM(backbone=backbone, preprocessor=None)
    x = {"token_ids": np.ones((2, 8), "int32"), "padding_mask": np.ones((2, 8), "int32")}
    return lm, x


def test_a_keras_trace_registers_gradients_and_kmix_calls_leave_none(tmp_path):
    lm, x = _silu_lm()
    before = _registered()
    lm.predict(x, verbose=0)
    assert len(_registered() - before) > 0  # the leak kmix works around: Keras's own trace registers some

    before = _registered()
    kmix.autocast(lm, "O1-bfloat16")
    kmix.export(lm, str(tmp_path / "served"), sample=x, verbose=False)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    kmix.recommend(lm, x, x["token_ids"], loss=loss, batch_size=2, budget_s=5, verbose=False)
    assert _registered() - before == set()


def test_autocast_of_a_keras_hub_task_creates_no_weights():
    """A keras-hub task compiles itself in its constructor: its twin is still built without weights."""
    from tests.testing import created_variables

    lm, x = _silu_lm()
    lm.predict(x, verbose=0)
    weights = sum(int(np.prod(v.shape)) for v in lm.weights)
    with created_variables() as created:
        kmix.autocast(lm, "O1-bfloat16")
    assert sum(int(np.prod(v.shape)) for v in created) < 0.05 * weights
