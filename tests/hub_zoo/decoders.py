"""keras-hub decoder LLM backbones built tiny (see `tests.hub_zoo`).

Every builder makes a 2-layer model with a hidden size of 16 and no
dropout, and returns it with a batch of two token rows of length 8 (see
`text_batch`): ids in `[1, vocabulary)`, the second row padded after 5
tokens. Mixture-of-experts models get 4 experts, 2 per token. Multimodal
decoders (Gemma3, Gemma3n, Gemma4) are built text-only.
"""

import keras_hub
import numpy as np

VOCABULARY = 64
SEQUENCE = 8
PADDED_AFTER = 5
_DECODER = {"num_layers": 2, "hidden_dim": 16, "intermediate_dim": 32, "vocabulary_size": VOCABULARY}
_GQA = {**_DECODER, "num_query_heads": 2, "num_key_value_heads": 1}
_MOE = {"num_experts": 4, "top_k": 2}


def text_batch(backbone, seed=0):
    """Token ids, padding mask (and positions) for `backbone`'s inputs, the second row padded.

    Args:
        backbone: a built backbone whose inputs are among `token_ids`,
            `padding_mask` (int or bool) and `position_ids`, as a dict or a list.
        seed: the generator's seed.

    Returns:
        Arrays of shape `(2, SEQUENCE)` in `backbone.input`'s structure and
        dtypes: ids in `[1, VOCABULARY)` (0 on padding), mask 1 / 0, positions
        `0..SEQUENCE-1`.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCABULARY, size=(2, SEQUENCE))
    mask = np.ones((2, SEQUENCE))
    mask[1, PADDED_AFTER:] = 0
    ids[1, PADDED_AFTER:] = 0
    values = {"token_ids": ids, "padding_mask": mask, "position_ids": np.tile(np.arange(SEQUENCE), (2, 1))}
    spec = backbone.input
    if isinstance(spec, dict):
        return {key: values[key].astype(tensor.dtype) for key, tensor in spec.items()}
    return [values[tensor.name].astype(tensor.dtype) for tensor in spec]


def _built(cls, **kwargs):
    backbone = getattr(keras_hub.models, cls)(**kwargs)
    return backbone, text_batch(backbone)


def build_bloom():
    """`BloomBackbone`: ALiBi attention, LayerNorm after the embedding."""
    return _built("BloomBackbone", num_heads=2, **_DECODER)


def build_falcon():
    """`FalconBackbone`: parallel attention and MLP, ALiBi."""
    return _built("FalconBackbone", num_attention_heads=2, **_DECODER)


def build_gpt2():
    """`GPT2Backbone`: learned positions, LayerNorm, GELU."""
    return _built("GPT2Backbone", num_heads=2, dropout=0.0, max_sequence_length=16, **_DECODER)


def build_gpt_neo_x():
    """`GPTNeoXBackbone`: partial rotary embeddings, parallel residual."""
    return _built("GPTNeoXBackbone", num_heads=2, max_sequence_length=16, **_DECODER)


def build_gemma():
    """`GemmaBackbone`: grouped-query attention, RMS norms, scaled embeddings."""
    return _built("GemmaBackbone", head_dim=8, **_GQA)


def build_gemma3():
    """`Gemma3Backbone`, text only: query-key norms, post norms, local / global attention."""
    return _built(
        "Gemma3Backbone", image_size=16, head_dim=8, use_post_ffw_norm=True, use_post_attention_norm=True,
        use_sliding_window_attention=True, sliding_window_size=4, **_GQA,
    )


def build_gemma3n():
    """`Gemma3nBackbone`, text only: AltUp, Laurel, per-layer inputs, local / global attention."""
    return _built(
        "Gemma3nBackbone", text_vocab_size=VOCABULARY, text_hidden_size=16, num_hidden_layers=2,
        pad_token_id=0, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=[32, 32],
        hidden_activation="gelu_approximate", layer_types=["sliding_attention", "full_attention"],
        sliding_window=4, rope_theta=10000.0, max_position_embeddings=16, vocab_size_per_layer_input=VOCABULARY,
        hidden_size_per_layer_input=4, altup_num_inputs=2, laurel_rank=2,
    )


def build_gemma4():
    """`Gemma4Backbone`, text only: local / global attention, explicit positions."""
    return _built(
        "Gemma4Backbone", image_size=16, head_dim=8, sliding_window_size=4, sliding_window_pattern=2, **_GQA
    )


def build_gpt_oss():
    """`GptOssBackbone`: mixture of experts, attention sinks, sliding window."""
    return _built("GptOssBackbone", head_dim=8, sliding_window=4, **_GQA, **_MOE)


def build_llama():
    """`LlamaBackbone`: rotary embeddings, grouped-query attention, SwiGLU."""
    return _built("LlamaBackbone", **_GQA)


def build_llama3():
    """`Llama3Backbone`: Llama with Llama 3.1's rotary frequency scaling."""
    return _built(
        "Llama3Backbone", rope_position_scaling_factor=8.0, rope_frequency_adjustment_factor=8.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_pretraining_sequence_length=16, **_GQA,
    )


def build_mistral():
    """`MistralBackbone`: Llama with sliding-window attention."""
    return _built("MistralBackbone", sliding_window=4, **_GQA)


def build_mixtral():
    """`MixtralBackbone`: sparse mixture of experts with a load-balancing loss."""
    return _built("MixtralBackbone", sliding_window=4, **_GQA, **_MOE)


def build_opt():
    """`OPTBackbone`: learned positions, pre-LayerNorm, ReLU."""
    return _built("OPTBackbone", num_heads=2, dropout=0.0, max_sequence_length=16, **_DECODER)


def build_phi3():
    """`Phi3Backbone`: fused projections, rotary embeddings."""
    return _built(
        "Phi3Backbone", max_sequence_length=16, pretraining_sequence_length=16, **_GQA
    )


def build_qwen():
    """`QwenBackbone` (Qwen 2): biased query / key / value, tied embeddings."""
    return _built("QwenBackbone", **_GQA)


def build_qwen2():
    """`Qwen2Backbone`: the same class as `QwenBackbone`, its other export."""
    return _built("Qwen2Backbone", use_sliding_window_attention=True, sliding_window_size=4, **_GQA)


def build_qwen3():
    """`Qwen3Backbone`: query-key RMS norms."""
    return _built("Qwen3Backbone", head_dim=8, **_GQA)


def build_qwen_moe():
    """`QwenMoeBackbone`: experts plus a gated shared expert, load-balancing loss."""
    return _built("QwenMoeBackbone", moe_intermediate_dim=16, shared_expert_intermediate_dim=32, **_GQA, **_MOE)


def build_qwen3_moe():
    """`Qwen3MoeBackbone`: query-key norms, experts, load-balancing loss."""
    return _built("Qwen3MoeBackbone", head_dim=8, moe_intermediate_dim=16, **_GQA, **_MOE)


_LINEAR = {
    "head_dim": 8, "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
    "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
}


def build_qwen3_5():
    """`Qwen3_5Backbone`, text only: a gated delta-net layer, then a full-attention layer."""
    return _built("Qwen3_5Backbone", **_LINEAR, **_GQA)


def build_qwen3_5_moe():
    """`Qwen3_5MoeBackbone`, text only: Qwen3.5's layers with experts and a shared expert."""
    gqa = {key: value for key, value in _GQA.items() if key != "intermediate_dim"}
    return _built(
        "Qwen3_5MoeBackbone", moe_intermediate_dim=16, shared_expert_intermediate_size=16, **_LINEAR, **gqa, **_MOE
    )


def build_rwkv7():
    """`RWKV7Backbone`: a recurrent (linear attention) decoder with LoRA-sized mixers."""
    backbone = keras_hub.models.RWKV7Backbone(
        hidden_size=16, head_size=8, num_layers=2, vocabulary_size=VOCABULARY, intermediate_dim=32,
        gate_lora=8, mv_lora=8, aaa_lora=8, decay_lora=8,
    )
    return backbone, text_batch(backbone)


def _smollm3(cls):
    return _built(
        cls, vocabulary_size=VOCABULARY, hidden_dim=16, intermediate_dim=32, num_layers=2, num_attention_heads=2,
        num_key_value_heads=1, attention_bias=False, attention_dropout=0.0, rope_layer_enabled_list=[True, False],
        layer_types=["attention", "attention"], mlp_bias=False, layer_norm_epsilon=1e-6,
        max_position_embeddings=16, rope_theta=10000.0, partial_rotary_factor=1.0,
    )


def build_smollm3():
    """`SmolLM3Backbone`: rotary embeddings on some layers only (NoPE on the others)."""
    return _smollm3("SmolLM3Backbone")


def build_smollm():
    """`SmolLMBackbone`: the same class as `SmolLM3Backbone`, its other export."""
    return _smollm3("SmolLMBackbone")


BUILDERS = {
    "BloomBackbone": build_bloom,
    "FalconBackbone": build_falcon,
    "GPT2Backbone": build_gpt2,
    "GPTNeoXBackbone": build_gpt_neo_x,
    "GemmaBackbone": build_gemma,
    "Gemma3Backbone": build_gemma3,
    "Gemma3nBackbone": build_gemma3n,
    "Gemma4Backbone": build_gemma4,
    "GptOssBackbone": build_gpt_oss,
    "Llama3Backbone": build_llama3,
    "LlamaBackbone": build_llama,
    "MistralBackbone": build_mistral,
    "MixtralBackbone": build_mixtral,
    "OPTBackbone": build_opt,
    "Phi3Backbone": build_phi3,
    "Qwen2Backbone": build_qwen2,
    "Qwen3Backbone": build_qwen3,
    "Qwen3MoeBackbone": build_qwen3_moe,
    "Qwen3_5Backbone": build_qwen3_5,
    "Qwen3_5MoeBackbone": build_qwen3_5_moe,
    "QwenBackbone": build_qwen,
    "QwenMoeBackbone": build_qwen_moe,
    "RWKV7Backbone": build_rwkv7,
    "SmolLM3Backbone": build_smollm3,
    "SmolLMBackbone": build_smollm,
}
"""keras-hub backbones built tiny: decoders (see `tests.hub_zoo`)."""
