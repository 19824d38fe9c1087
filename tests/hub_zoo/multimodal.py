"""keras-hub video, multimodal and generative backbones built tiny (see `tests.hub_zoo`).

As in `tests.hub_zoo.vision`, whose inputs (`images`, `sentences`,
`text_batch`) they share: hidden sizes of 8-32, one or two layers, a batch of
two from fixed seeds, token ids packed as each class's tokenizer packs them.
"""

import keras_hub
import numpy as np

# keras-hub 0.32 does not export the VAE that StableDiffusion3Backbone needs
# (its docstring's `keras_hub.models.VAEBackbone` does not exist).
from keras_hub.src.models.vae.vae_backbone import VAEBackbone

from tests.hub_zoo.vision import _TRANSFORMER, SEQUENCE, VOCABULARY, _vit_det, images, sentences, text_batch


def _contrastive(family, value_range, token_ids, text_args=None, **kwargs):
    """`keras_hub.models.<family>Backbone` on tiny `<family>VisionEncoder` / `TextEncoder`s."""
    text_args = {"embedding_dim": 16, "max_sequence_length": SEQUENCE, **(text_args or {})}
    vision = getattr(keras_hub.models, f"{family}VisionEncoder")(
        patch_size=8, image_shape=(32, 32, 3), **_TRANSFORMER
    )
    text = getattr(keras_hub.models, f"{family}TextEncoder")(
        vocabulary_size=VOCABULARY, **text_args, **_TRANSFORMER
    )
    backbone = getattr(keras_hub.models, f"{family}Backbone")(vision_encoder=vision, text_encoder=text, **kwargs)
    return backbone, {"images": images(32, value_range), "token_ids": token_ids}


def build_clip():
    """`CLIPBackbone`. CLIP's vocabulary ends with its start and end tokens; the pooler finds the
    end token as the largest id; padding is 0."""
    token_ids = sentences((1, VOCABULARY - 2), start=VOCABULARY - 2, end=VOCABULARY - 1)
    return _contrastive("CLIP", "imagenet", token_ids, projection_dim=16)


def build_metaclip_2():
    """`MetaCLIP2Backbone`. Its tokenizer: <s> 0, <pad> 1, </s> 2 (the pooler's end token)."""
    token_ids = sentences((4, VOCABULARY), start=0, end=2, pad=1)
    return _contrastive("MetaCLIP2", "imagenet", token_ids, projection_dim=16)


def build_siglip():
    """`SigLIPBackbone`. SigLIP pads with its end token </s> (1), so every row ends with one
    ("sticky" EOS, which its text head reads)."""
    return _contrastive("SigLIP", "symmetric", sentences((2, VOCABULARY), end=1, pad=1))


def build_pali_gemma():
    """`PaliGemmaBackbone`: 16 image tokens, a 4-token prompt (block attention), then the
    response (causal)."""
    backbone = keras_hub.models.PaliGemmaBackbone(
        vocabulary_size=VOCABULARY, image_size=16, num_layers=2, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8, vit_patch_size=4, vit_num_heads=2, vit_hidden_dim=16,
        vit_num_layers=2, vit_intermediate_dim=32,
    )
    token_ids, padding_mask = text_batch()
    response_mask = padding_mask.copy()
    response_mask[:, :4] = 0
    return backbone, {
        "images": images(16, "symmetric"), "token_ids": token_ids, "padding_mask": padding_mask,
        "response_mask": response_mask,
    }


def build_blip2():
    """`BLIP2Backbone`: ViT, a Q-Former of 4 queries with cross-attention in every layer, OPT."""
    vision_encoder = keras_hub.models.BLIP2VisionEncoder(
        image_size=16, patch_size=4, use_patch_bias=True, use_class_token=True, use_mha_bias=True,
        use_mlp_bias=True, dropout_rate=0.0, layer_norm_epsilon=1e-6, initializer_range=0.02, **_TRANSFORMER,
    )
    qformer = keras_hub.models.BLIP2QFormer(
        num_query_tokens=4, vision_dim=16, cross_attention_frequency=1, dropout=0.0, layer_norm_epsilon=1e-6,
        **_TRANSFORMER,
    )
    language_model = keras_hub.models.BLIP2CustomOPT(
        vocabulary_size=VOCABULARY, num_query_tokens=4, dropout=0.0, max_sequence_length=16,
        qformer_hidden_dim=16, **_TRANSFORMER,
    )
    backbone = keras_hub.models.BLIP2Backbone(
        vision_encoder=vision_encoder, qformer=qformer, language_model=language_model
    )
    token_ids, padding_mask = text_batch()
    return backbone, {"images": images(16, "imagenet"), "token_ids": token_ids, "padding_mask": padding_mask}


def build_parseq():
    """`PARSeqBackbone` on a ViT over 16x32 text crops (patches 4x8, no class token).

    PARSeq's vocabulary: [E] 0 (end), the characters, [B] (start), [P]
    (padding) last; a label of at most 6 characters is packed as
    [B] c ... c [E] [P] ..., 7 positions.
    """
    vocabulary_size, start, pad = 16, 14, 15
    encoder = keras_hub.models.ViTBackbone(
        image_shape=(16, 32, 3), patch_size=(4, 8), num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
        use_class_token=False,
    )
    backbone = keras_hub.models.PARSeqBackbone(
        image_encoder=encoder, vocabulary_size=vocabulary_size, max_label_length=6, decoder_hidden_dim=16,
        num_decoder_layers=1, num_decoder_heads=2, decoder_mlp_dim=32, dropout_rate=0.0, attention_dropout=0.0,
    )
    token_ids = sentences((1, start), start=start, end=0, pad=pad, length=7)
    return backbone, {
        "images": images((16, 32), "symmetric"), "token_ids": token_ids,
        "padding_mask": (token_ids != pad).astype("int32"),
    }


def build_video_prism():
    """`VideoPrismBackbone`, video-text: factorized space-time encoder, attention pooling, and a
    causal text encoder over padded token ids."""
    backbone = keras_hub.models.VideoPrismBackbone(
        num_frames=2, patch_size=8, hidden_dim=16, intermediate_dim=32, num_heads=2, num_spatial_layers=1,
        num_temporal_layers=1, num_auxiliary_layers=1, vocabulary_size=VOCABULARY, num_text_layers=1,
        image_shape=(16, 16, 3),
    )
    token_ids, padding_mask = text_batch()
    return backbone, {
        "pixel_values": images(16, "unit", frames=2), "token_ids": token_ids, "padding_mask": padding_mask,
    }


# --- Promptable segmentation ---------------------------------------------------------


def build_sam():
    """`SAMBackbone` on a ViTDet: an 8x8 image embedding, points, boxes and no mask prompt.

    Two clicks in pixel coordinates, foreground and background, the second
    image's second click padding (label -1); one box (corners) each; zero
    masks, as SAM's preprocessor sends without a mask prompt.
    """
    prompt_encoder = keras_hub.layers.SAMPromptEncoder(
        hidden_size=8, image_embedding_size=(8, 8), input_image_size=(32, 32), mask_in_channels=16
    )
    mask_decoder = keras_hub.layers.SAMMaskDecoder(
        num_layers=2, hidden_size=8, intermediate_dim=16, num_heads=2, embedding_dim=8, num_multimask_outputs=3,
        iou_head_depth=2, iou_head_hidden_dim=8,
    )
    backbone = keras_hub.models.SAMBackbone(
        image_encoder=_vit_det(), prompt_encoder=prompt_encoder, mask_decoder=mask_decoder
    )
    return backbone, {
        "images": images(32, "imagenet"),
        "points": np.array([[[8, 10], [20, 24]], [[16, 5], [0, 0]]], "float32"),
        "labels": np.array([[1, 0], [1, -1]], "float32"),
        "boxes": np.array([[[[4, 4], [28, 30]]], [[[10, 2], [22, 16]]]], "float32"),
        "masks": np.zeros((2, 0, 32, 32, 1), "float32"),
    }


def build_sam3():
    """`SAM3PromptableConceptBackbone`: a text prompt and one box per image.

    32x32 images in patches of 4 (an 8x8 grid); the FPN's 4x, 2x and 1x levels
    feed the mask decoder's three upsampling stages. The text is packed
    CLIP-style and padded with the end token; boxes are sent as the
    preprocessor sends them, [batch index, cx, cy, w, h] in [0, 1]. keras-hub
    0.32's backbone hands the geometry encoder the labels as the box mask and
    the mask as the labels, so a padding box (label -10) crashes and a
    negative box (label 0) is read as padding: one positive box each.
    """
    layers, small = keras_hub.layers, {"hidden_dim": 16, "intermediate_dim": 32, "num_heads": 2}
    backbone = keras_hub.models.SAM3PromptableConceptBackbone(
        vision_encoder=layers.SAM3VisionEncoder(
            image_shape=(32, 32, 3), patch_size=4, num_layers=2, fpn_hidden_dim=16,
            fpn_scale_factors=[4.0, 2.0, 1.0, 0.5], pretrain_image_shape=(16, 16, 3), window_size=2,
            global_attn_indexes=[1], **small,
        ),
        text_encoder=layers.SAM3TextEncoder(
            vocabulary_size=VOCABULARY, embedding_dim=16, num_layers=2, max_sequence_length=SEQUENCE, **small
        ),
        geometry_encoder=layers.SAM3GeometryEncoder(num_layers=1, roi_size=2, **small),
        detr_encoder=layers.SAM3DetrEncoder(num_layers=1, **small),
        detr_decoder=layers.SAM3DetrDecoder(
            image_shape=(32, 32, 3), patch_size=4, num_layers=2, num_queries=8, **small
        ),
        mask_decoder=layers.SAM3MaskDecoder(num_upsampling_stages=3, hidden_dim=16, num_heads=2),
    )
    end = VOCABULARY - 1
    token_ids = sentences((1, end - 1), start=end - 1, end=end, pad=end)
    padding_mask = np.ones_like(token_ids)
    padding_mask[1, -2:] = 0
    return backbone, {
        "pixel_values": images(32, "symmetric"),
        "token_ids": token_ids,
        "padding_mask": padding_mask,
        "boxes": np.array([[[0, 0.5, 0.5, 0.4, 0.6]], [[1, 0.4, 0.6, 0.5, 0.3]]], "float32"),
        "box_labels": np.ones((2, 1), "int32"),
    }


# --- Diffusion -------------------------------------------------------------------------


def build_stable_diffusion_3():
    """`StableDiffusion3Backbone`: VAE, CLIP-L and CLIP-G, and SD3.5's MMDiT (RMS-normed queries
    and keys, a dual-attention first layer).

    32x32 images; the VAE (stride 8, group norms of 32 groups, so 32 filters)
    gives 4x4x16 latents, 2x2 patches of 2 for the MMDiT. Prompts are packed
    CLIP-style (CLIP-L pads with its end token, CLIP-G with 0), the negative
    prompt is the empty one, the latents are standard normal noise.
    """
    vae = VAEBackbone(
        encoder_num_filters=[32] * 4, encoder_num_blocks=[1] * 4, decoder_num_filters=[32] * 4,
        decoder_num_blocks=[1] * 4, sampler_method="mode",
    )
    # SD3 reads each CLIP's penultimate layer (intermediate_output_index=-2).
    clip_l = keras_hub.models.CLIPTextEncoder(
        vocabulary_size=VOCABULARY, embedding_dim=16, intermediate_output_index=-2, max_sequence_length=SEQUENCE,
        name="clip_l", **_TRANSFORMER,
    )
    clip_g = keras_hub.models.CLIPTextEncoder(
        vocabulary_size=VOCABULARY, embedding_dim=32, hidden_dim=32, num_layers=2, num_heads=2,
        intermediate_dim=64, intermediate_activation="gelu", intermediate_output_index=-2,
        max_sequence_length=SEQUENCE, name="clip_g",
    )
    backbone = keras_hub.models.StableDiffusion3Backbone(
        mmdit_patch_size=2, mmdit_hidden_dim=16, mmdit_num_layers=2, mmdit_num_heads=2, mmdit_position_size=4,
        mmdit_qk_norm="rms_norm", mmdit_dual_attention_indices=(0,), vae=vae, clip_l=clip_l, clip_g=clip_g,
        image_shape=(32, 32, 3),
    )
    start, end = VOCABULARY - 2, VOCABULARY - 1
    empty_l = np.array([[start, end] + [end] * (SEQUENCE - 2)] * 2, "int32")
    empty_g = np.array([[start, end] + [0] * (SEQUENCE - 2)] * 2, "int32")
    return backbone, {
        "images": images(32, "symmetric"),
        "latents": np.random.default_rng(2).standard_normal((2, 4, 4, 16)).astype("float32"),
        "clip_l_token_ids": sentences((1, start), start=start, end=end, pad=end),
        "clip_l_negative_token_ids": empty_l,
        "clip_g_token_ids": sentences((1, start), start=start, end=end, pad=0),
        "clip_g_negative_token_ids": empty_g,
        "num_steps": np.full((2,), 4, "int32"),
        "guidance_scale": np.full((2,), 7.0, "float32"),
    }


def build_flux():
    """`FluxBackbone`, guidance-distilled (dev): one double- and one single-stream block.

    Flux takes packed latents: a 4x4x4 latent in 2x2 patches is 4 tokens of 16
    channels, each with its position id (0, row, column); the text tokens (T5
    outputs) have position ids 0; `y` is CLIP's pooled embedding; timesteps
    are in [0, 1]. `axes_dim` splits the head dimension (8) for rotary
    positions.
    """
    rng = np.random.default_rng(3)
    backbone = keras_hub.models.FluxBackbone(
        input_channels=16, hidden_size=16, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1,
        axes_dim=[2, 2, 4], theta=10_000, use_bias=True, guidance_embed=True, image_shape=(4, 16),
        text_shape=(6, 16), image_ids_shape=(4, 3), text_ids_shape=(6, 3), y_shape=(8,),
    )
    rows, columns = np.meshgrid(np.arange(2), np.arange(2), indexing="ij")
    positions = np.stack([np.zeros(4), rows.ravel(), columns.ravel()], axis=-1)
    return backbone, {
        "image": rng.standard_normal((2, 4, 16)).astype("float32"),
        "image_ids": np.broadcast_to(positions, (2, 4, 3)).astype("float32"),
        "text": (0.5 * rng.standard_normal((2, 6, 16))).astype("float32"),
        "text_ids": np.zeros((2, 6, 3), "float32"),
        "y": rng.standard_normal((2, 8)).astype("float32"),
        "timesteps": np.array([0.25, 0.75], "float32"),
        "guidance": np.full((2,), 3.5, "float32"),
    }


BUILDERS = {
    "BLIP2Backbone": build_blip2,
    "CLIPBackbone": build_clip,
    "FluxBackbone": build_flux,
    "MetaCLIP2Backbone": build_metaclip_2,
    "PARSeqBackbone": build_parseq,
    "PaliGemmaBackbone": build_pali_gemma,
    "SAM3PromptableConceptBackbone": build_sam3,
    "SAMBackbone": build_sam,
    "SigLIPBackbone": build_siglip,
    "StableDiffusion3Backbone": build_stable_diffusion_3,
    "VideoPrismBackbone": build_video_prism,
}
