"""`kmix.export` of keras-hub causal LMs that `kmix.autocast` placed in half precision, with and without LoRA.

keras-hub backbones hold a `DTypePolicyMap` beside their layers' `DTypePolicy`s; export
puts every layer back after writing, and must do so without comparing the two (Keras's
`DTypePolicy.__eq__` raises against a map). The reference is the placed model's own
`predict` before the export (bitwise after it) and the float32 model's (the served outputs).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kmix
from tests.hub_zoo import decoders
from tests.testing import FULL, full_only

keras_hub = pytest.importorskip("keras_hub")

# (backbone builder, causal LM class, LoRA, policy): every causal LM both halves under KMIX_FULL_TESTS.
_QUICK = [("build_qwen2", "Qwen2CausalLM", True, "O1-bfloat16"),
          ("build_llama", "LlamaCausalLM", True, "O1"),
          ("build_gemma", "GemmaCausalLM", False, "O1-bfloat16")]
_LMS = {"build_qwen2": "Qwen2CausalLM", "build_llama": "LlamaCausalLM", "build_gemma": "GemmaCausalLM",
        "build_mistral": "MistralCausalLM", "build_gpt2": "GPT2CausalLM", "build_phi3": "Phi3CausalLM",
        "build_opt": "OPTCausalLM", "build_bloom": "BloomCausalLM", "build_falcon": "FalconCausalLM",
        "build_gpt_neo_x": "GPTNeoXCausalLM", "build_qwen3": "Qwen3CausalLM", "build_llama3": "Llama3CausalLM"}
_FULL = [(b, lm, lora, policy) for b, lm in _LMS.items() for lora in (True, False)
         for policy in ("O1", "O1-bfloat16") if (b, lm, lora, policy) not in _QUICK]


def _served(path):
    loaded = tf.saved_model.load(path)  # kept in a variable while called (see design.md)
    return loaded, loaded.signatures["serving_default"]


def _check(tmp_path, builder, lm_class, lora, policy):
    keras.utils.set_random_seed(0)
    backbone, x = getattr(decoders, builder)()
    if lora:
        backbone.enable_lora(rank=2)
    lm = getattr(keras_hub.models, lm_class)(backbone=backbone, preprocessor=None)
    float32 = lm.predict(x, verbose=0)
    kmix.autocast(lm, policy)
    placed = lm.predict(x, verbose=0)
    policies = [(layer.path, layer.dtype_policy) for layer in lm._flatten_layers()]
    # keras-hub's DTypePolicyMap is shared by the backbone's layers: its entries must be put back too.
    map_names = [(p, {k: v.name for k, v in p._policy_map.items()})
                 for p in {id(p): p for _, p in policies if hasattr(p, "_policy_map")}.values()]
    weights = [v.numpy().tobytes() for v in lm.weights]

    report = kmix.export(lm, str(tmp_path / "lm"), sample=x, verbose=False)

    # The model as it was: the same policy objects, the same weights, the same predictions.
    after = [(layer.path, layer.dtype_policy) for layer in lm._flatten_layers()]
    assert [path for path, _ in after] == [path for path, _ in policies]
    assert all(a is b for (_, a), (_, b) in zip(after, policies))  # identity: `==` raises on a DTypePolicyMap
    assert all({k: v.name for k, v in m._policy_map.items()} == names for m, names in map_names)
    assert [v.numpy().tobytes() for v in lm.weights] == weights
    np.testing.assert_array_equal(lm.predict(x, verbose=0), placed)
    lm.predict_function = None  # retraced: the layers' policies, not a cached function, give the answer
    np.testing.assert_array_equal(lm.predict(x, verbose=0), placed)
    # The artifact serves what the float32 model predicts, within the half dtype's rounding.
    _, serve = _served(str(tmp_path / "lm"))
    got = serve(**{k: tf.constant(v) for k, v in x.items()})
    got = next(iter(got.values())).numpy()
    scale = np.abs(float32).max()
    assert np.abs(got - float32).max() <= 0.05 * scale
    assert report.max_abs_diff <= 0.05 * scale


@pytest.mark.parametrize("builder,lm_class,lora,policy", _QUICK)
def test_export_of_a_placed_causal_lm(tmp_path, builder, lm_class, lora, policy):
    _check(tmp_path, builder, lm_class, lora, policy)


@full_only("every keras-hub causal LM, with and without LoRA, both halves: about 5 min")
@pytest.mark.parametrize("builder,lm_class,lora,policy", _FULL)
def test_export_of_every_placed_causal_lm(tmp_path, builder, lm_class, lora, policy):
    _check(tmp_path, builder, lm_class, lora, policy)
