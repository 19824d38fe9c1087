"""`kmix.export` of keras-hub causal LMs that `kmix.autocast` placed in half precision, with and without LoRA.

keras-hub backbones hold a `DTypePolicyMap` beside their layers' `DTypePolicy`s; export
puts every layer back after writing, and must do so without comparing the two (Keras's
`DTypePolicy.__eq__` raises against a map). The reference is the placed model's own
`predict` before the export (bitwise after it) and the float32 model's (the served outputs).
The export's traces (silu is a `tf.custom_gradient`) must also leave no gradient function
registered once it returns (see tests/test_calls_keep_nothing.py).

The quick cases build one decoder block (the export's work grows with the blocks); every
causal LM of `tests.hub_zoo.decoders`, two blocks, runs under KMIX_FULL_TESTS.
"""

import functools
import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

from tensorflow.python.framework import ops

import kmix
from tests.hub_zoo import decoders
from tests.testing import FULL, full_only

keras_hub = pytest.importorskip("keras_hub")


def _one_block(backbone_class, **kwargs):
    """A one-block decoder as `tests.hub_zoo.decoders` builds them (hidden 16, grouped-query), and its batch."""
    backbone = getattr(keras_hub.models, backbone_class)(
        vocabulary_size=decoders.VOCABULARY, num_layers=1, hidden_dim=16, intermediate_dim=32, num_query_heads=2,
        num_key_value_heads=1, **kwargs)
    return backbone, decoders.text_batch(backbone)


# (backbone builder, causal LM class, LoRA, policy): every causal LM both halves under KMIX_FULL_TESTS.
_QUICK = [("Qwen2Backbone", "Qwen2CausalLM", True, "O1-bfloat16"),
          ("LlamaBackbone", "LlamaCausalLM", True, "O1"),
          ("GemmaBackbone", "GemmaCausalLM", False, "O1-bfloat16")]
_QUICK_BUILD = {"Qwen2Backbone": {}, "LlamaBackbone": {}, "GemmaBackbone": {"head_dim": 8}}
_LMS = {"build_qwen2": "Qwen2CausalLM", "build_llama": "LlamaCausalLM", "build_gemma": "GemmaCausalLM",
        "build_mistral": "MistralCausalLM", "build_gpt2": "GPT2CausalLM", "build_phi3": "Phi3CausalLM",
        "build_opt": "OPTCausalLM", "build_bloom": "BloomCausalLM", "build_falcon": "FalconCausalLM",
        "build_gpt_neo_x": "GPTNeoXCausalLM", "build_qwen3": "Qwen3CausalLM", "build_llama3": "Llama3CausalLM"}
_FULL = [(b, lm, lora, policy) for b, lm in _LMS.items() for lora in (True, False)
         for policy in ("O1", "O1-bfloat16") if (lm, lora, policy) not in [q[1:] for q in _QUICK]]


def _served(path):
    loaded = tf.saved_model.load(path)  # kept in a variable while called (see design.md)
    return loaded, loaded.signatures["serving_default"]


def _call(lm, x):
    """`lm`'s logits on `x`, called eagerly: no `predict` trace."""
    return keras.ops.convert_to_numpy(lm(x, training=False))


def _registered():
    """The names of the custom gradients TensorFlow's gradient registry holds (see tests/test_calls_keep_nothing.py)."""
    gc.collect()
    return {name for name in ops.gradient_registry._registry if name.startswith("CustomGradient-")}


def _check(tmp_path, build, lm_class, lora, policy):
    keras.utils.set_random_seed(0)
    backbone, x = build()
    if lora:
        backbone.enable_lora(rank=2)
    lm = getattr(keras_hub.models, lm_class)(backbone=backbone, preprocessor=None)
    float32 = _call(lm, x)
    kmix.autocast(lm, policy)
    placed, placed_eagerly = lm.predict(x, verbose=0), _call(lm, x)
    policies = [(layer.path, layer.dtype_policy) for layer in lm._flatten_layers()]
    # keras-hub's DTypePolicyMap is shared by the backbone's layers: its entries must be put back too.
    map_names = [(p, {k: v.name for k, v in p._policy_map.items()})
                 for p in {id(p): p for _, p in policies if hasattr(p, "_policy_map")}.values()]
    weights = [v.numpy().tobytes() for v in lm.weights]

    registered = _registered()
    report = kmix.export(lm, str(tmp_path / "lm"), sample=x, verbose=False)
    assert _registered() - registered == set()  # its traces' gradient functions gone with it

    # The model as it was: the same policy objects, the same weights, the same predictions.
    after = [(layer.path, layer.dtype_policy) for layer in lm._flatten_layers()]
    assert [path for path, _ in after] == [path for path, _ in policies]
    assert all(a is b for (_, a), (_, b) in zip(after, policies))  # identity: `==` raises on a DTypePolicyMap
    assert all({k: v.name for k, v in m._policy_map.items()} == names for m, names in map_names)
    assert [v.numpy().tobytes() for v in lm.weights] == weights
    np.testing.assert_array_equal(lm.predict(x, verbose=0), placed)  # the function traced before the export
    # Computed afresh: the layers' policies, not a cached function, give the answer (eager, as before the export).
    np.testing.assert_array_equal(_call(lm, x), placed_eagerly)
    # The artifact serves what the float32 model predicts, within the half dtype's rounding.
    _, serve = _served(str(tmp_path / "lm"))
    got = serve(**{k: tf.constant(v) for k, v in x.items()})
    got = next(iter(got.values())).numpy()
    scale = np.abs(float32).max()
    assert np.abs(got - float32).max() <= 0.05 * scale
    assert report.max_abs_diff <= 0.05 * scale


@pytest.mark.parametrize("backbone,lm_class,lora,policy", _QUICK)
def test_export_of_a_placed_causal_lm(tmp_path, backbone, lm_class, lora, policy):
    _check(tmp_path, functools.partial(_one_block, backbone, **_QUICK_BUILD[backbone]), lm_class, lora, policy)


@full_only("every keras-hub causal LM, with and without LoRA, both halves: about 5 min")
@pytest.mark.parametrize("builder,lm_class,lora,policy", _FULL)
def test_export_of_every_placed_causal_lm(tmp_path, builder, lm_class, lora, policy):
    _check(tmp_path, getattr(decoders, builder), lm_class, lora, policy)


def test_the_half_copies_are_freed_before_the_artifact_is_read_back(tmp_path, monkeypatch):
    """The served trace's gradient registrations (Keras's silu) held it, and the half copies it captured, to the end.

    Read off TensorFlow's CPU allocator (its statistics need oneDNN, which tests/conftest.py turns on): when the
    artifact is read back, what export holds above the model is less than the half copies it wrote.
    """
    from kmix.serving import artifact

    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
    except ValueError:
        pytest.skip("TensorFlow's CPU allocator keeps no statistics here (oneDNN off)")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Qwen2Backbone(vocabulary_size=16384, num_layers=1, hidden_dim=64, intermediate_dim=32,
                                              num_query_heads=2, num_key_value_heads=1)  # mostly its token embedding
    x = decoders.text_batch(backbone)
    lm = keras_hub.models.Qwen2CausalLM(backbone=backbone, preprocessor=None)
    _call(lm, x)
    current = lambda: tf.config.experimental.get_memory_info("CPU:0")["current"]  # noqa: E731
    gc.collect()
    before, at_read_back, read = current(), [], artifact.read_saved_model
    monkeypatch.setattr(artifact, "read_saved_model", lambda path: at_read_back.append(current()) or read(path))
    report = kmix.export(lm, str(tmp_path / "lm"), sample=x, verbose=False)
    assert report.weight_bytes > 0.4 * report.float32_weight_bytes  # the half copies: most of the weights
    assert len(at_read_back) == 1 and at_read_back[0] - before < 0.5 * report.weight_bytes, (at_read_back, before)
