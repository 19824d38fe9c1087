"""keras-hub vision, video and multimodal backbones built tiny (see `tests.hub_zoo`).

Every builder makes its backbone with hidden sizes of 8-32, one or two layers
and the smallest image the class accepts (32x32 mostly), composite backbones
with their sub-models as small, and returns it with a batch of two drawn from
fixed seeds, valued as the class's preprocessor would hand it over: images in
[0, 1], [-1, 1] or ImageNet-normalized as its image converter gives them
(`images`), token ids packed as its tokenizer packs them (`sentences`,
`text_batch`), the second row padded. Where the class fixes a width (ResNet's
first stack, the FPN's and DeepLab's 256 filters, the VAE's multiples of 32)
that width is kept.
"""

import keras_hub
import numpy as np

# keras-hub 0.32 does not export the VAE that StableDiffusion3Backbone needs
# (its docstring's `keras_hub.models.VAEBackbone` does not exist).
from keras_hub.src.models.vae.vae_backbone import VAEBackbone

VOCABULARY = 64
SEQUENCE = 8
_IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], "float32")
_IMAGENET_STD = np.array([0.229, 0.224, 0.225], "float32")
_TRANSFORMER = {"num_layers": 2, "num_heads": 2, "hidden_dim": 16, "intermediate_dim": 32}


def images(size, value_range="unit", seed=0, frames=None):
    """A batch of two random images `size` x `size` x 3 (or videos), float32.

    Args:
        size: the height and width, an int or `(height, width)`.
        value_range: what the class's image converter hands the model:
            `"unit"` for [0, 1], `"symmetric"` for [-1, 1], `"imagenet"` for
            [0, 1] pixels normalized by the ImageNet mean and deviation.
        seed: the generator's seed.
        frames: with a number of frames, a video batch `(2, frames, h, w, 3)`.

    Returns:
        A float32 numpy array.
    """
    height, width = (size, size) if isinstance(size, int) else size
    shape = (2, height, width, 3) if frames is None else (2, frames, height, width, 3)
    pixels = np.random.default_rng(seed).uniform(0.0, 1.0, shape).astype("float32")
    if value_range == "symmetric":
        return pixels * 2.0 - 1.0
    if value_range == "imagenet":
        return (pixels - _IMAGENET_MEAN) / _IMAGENET_STD
    return pixels


def text_batch(seed=1):
    """Token ids in `[1, VOCABULARY)` and a padding mask, shape `(2, SEQUENCE)`, int32.

    The second row's last two positions are padding: id 0, mask 0.
    """
    token_ids = np.random.default_rng(seed).integers(1, VOCABULARY, (2, SEQUENCE)).astype("int32")
    padding_mask = np.ones((2, SEQUENCE), "int32")
    padding_mask[1, -2:] = 0
    token_ids[1, -2:] = 0
    return token_ids, padding_mask


def sentences(words, start=None, end=None, pad=0, length=SEQUENCE, seed=1):
    """Two sentences packed as a start/end packer packs them, int32 `(2, length)`.

    Each row is `[start] w ... w [end] pad ...` (start or end left out when
    None), the words drawn from the integer range `words`; the first row
    fills `length`, the second is two positions shorter and padded with `pad`.
    """
    rng = np.random.default_rng(seed)
    head, tail = [] if start is None else [start], [] if end is None else [end]
    rows = []
    for used in (length, length - 2):
        row = head + list(rng.integers(*words, used - len(head) - len(tail))) + tail
        rows.append(row + [pad] * (length - used))
    return np.array(rows, "int32")


def _fed(backbone, pixels):
    """`(backbone, pixels)`, the pixels keyed as the backbone's one input is if it is a dict."""
    if isinstance(backbone.input, dict):
        (key,) = backbone.input
        return backbone, {key: pixels}
    return backbone, pixels


def _image_model(cls, value_range, **kwargs):
    """A `keras_hub.models.<cls>` on 32x32 images and its batch."""
    return _fed(getattr(keras_hub.models, cls)(**kwargs), images(32, value_range))


# --- Convolutional image encoders --------------------------------------------


def build_cspnet():
    """`CSPNetBackbone`: two cross-stage-partial stages of dark blocks."""
    return _image_model(
        "CSPNetBackbone", "imagenet", stem_filters=8, stem_kernel_size=3, stem_strides=1,
        stackwise_depth=[1, 1], stackwise_strides=2, stackwise_num_filters=[8, 16],
        block_type="dark_block", stage_type="csp", down_growth=True, bottle_ratio=(0.5, 1.0),
        block_ratio=(1.0, 0.5), expand_ratio=(2.0, 1.0), stem_padding="same", image_shape=(32, 32, 3),
    )


def build_densenet():
    """`DenseNetBackbone`: two dense blocks of one layer (its stem has 64 filters)."""
    return _image_model(
        "DenseNetBackbone", "imagenet", stackwise_num_repeats=[1, 1], growth_rate=8, image_shape=(32, 32, 3)
    )


def build_efficientnet():
    """`EfficientNetBackbone`: a fused and an unfused MBConv stage, squeeze-and-excite."""
    return _image_model(
        "EfficientNetBackbone", "imagenet", dropout=0.0, stackwise_width_coefficients=[1.0, 1.0],
        stackwise_depth_coefficients=[1.0, 1.0], stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1],
        stackwise_input_filters=[8, 8], stackwise_output_filters=[8, 16], stackwise_expansion_ratios=[1, 4],
        stackwise_squeeze_and_excite_ratios=[0.0, 0.25], stackwise_strides=[1, 2],
        stackwise_block_types=["fused", "unfused"], stackwise_force_input_filters=[0, 0],
        stackwise_nores_option=[False, False], num_features=32, input_shape=(32, 32, 3),
    )


def build_hgnetv2():
    """`HGNetV2Backbone`: learnable affine blocks, a plain and a light stage."""
    return _image_model(
        "HGNetV2Backbone", "unit", depths=[1, 1], embedding_size=16, hidden_sizes=[16, 32],
        stem_channels=[3, 8, 16], hidden_act="relu", use_learnable_affine_block=True,
        stackwise_stage_filters=[[16, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3]], apply_downsample=[False, True],
        use_lightweight_conv_block=[False, True], image_shape=(32, 32, 3),
    )


def build_mobilenet():
    """`MobileNetBackbone`: inverted residuals with squeeze-and-excite, hard swish."""
    return _image_model(
        "MobileNetBackbone", "imagenet", stackwise_expansion=[[2], [4, 4]], stackwise_num_blocks=[1, 2],
        stackwise_num_filters=[[8], [16, 16]], stackwise_kernel_size=[[3], [5, 5]],
        stackwise_num_strides=[[2], [2, 1]], stackwise_se_ratio=[[None], [0.25, 0.25]],
        stackwise_activation=[["relu"], ["hard_swish", "hard_swish"]], stackwise_padding=[[1], [2, 2]],
        output_num_filters=32, depthwise_filters=8, depthwise_stride=2, depthwise_residual=False,
        last_layer_filter=32, squeeze_and_excite=0.5, input_num_filters=8, image_shape=(32, 32, 3),
    )


def build_mobilenetv5():
    """`MobileNetV5Backbone`: edge residual, universal inverted residual and multi-query attention
    stages, RMS norms, layer scale, the multi-scale fusion adapter."""
    return _image_model(
        "MobileNetV5Backbone", "symmetric", stackwise_block_types=[["er"], ["uir"], ["mqa"]],
        stackwise_num_blocks=[1, 1, 1], stackwise_num_filters=[[16], [16], [16]],
        stackwise_strides=[[2], [2], [1]], stackwise_act_layers=[["relu"], ["gelu"], ["gelu"]],
        stackwise_exp_ratios=[[2.0], [2.0], [0.0]], stackwise_se_ratios=[[0.0], [0.0], [0.0]],
        stackwise_dw_kernel_sizes=[[0], [3], [0]], stackwise_dw_start_kernel_sizes=[[0], [3], [0]],
        stackwise_dw_end_kernel_sizes=[[0], [0], [0]], stackwise_exp_kernel_sizes=[[3], [0], [0]],
        stackwise_pw_kernel_sizes=[[1], [0], [0]], stackwise_num_heads=[[0], [0], [2]],
        stackwise_key_dims=[[0], [0], [8]], stackwise_value_dims=[[0], [0], [8]],
        stackwise_kv_strides=[[0], [0], [2]], stackwise_use_cpe=[[False], [False], [False]], stem_size=8,
        num_features=32, use_msfa=True, msfa_indices=(-2, -1), msfa_output_resolution=4,
        layer_scale_init_value=1e-5, image_shape=(32, 32, 3),
    )


def build_resnet():
    """`ResNetBackbone` v2 (pre-activation basic blocks).

    The first stack must have 64 filters (a check in the class), and its first
    basic block adds the stem's output, so the stem has 64 too.
    """
    return _image_model(
        "ResNetBackbone", "imagenet", input_conv_filters=[64], input_conv_kernel_sizes=[7],
        stackwise_num_filters=[64, 16], stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2],
        block_type="basic_block", use_pre_activation=True, image_shape=(32, 32, 3),
    )


def build_vgg():
    """`VGGBackbone`: two conv + pool stages."""
    return _image_model(
        "VGGBackbone", "imagenet", stackwise_num_repeats=[1, 1], stackwise_num_filters=[8, 16],
        image_shape=(32, 32, 3),
    )


def build_xception():
    """`XceptionBackbone`: entry, one residual separable-conv block, exit."""
    return _image_model(
        "XceptionBackbone", "symmetric", stackwise_conv_filters=[[8, 16], [16, 32], [32, 32]],
        stackwise_pooling=[True, True, False], image_shape=(32, 32, 3),
    )


# --- Vision transformers -------------------------------------------------------


def build_deit():
    """`DeiTBackbone`: class and distillation tokens, 4x4 patches of 8."""
    return _image_model("DeiTBackbone", "imagenet", image_shape=(32, 32, 3), patch_size=8, **_TRANSFORMER)


def build_dinov2():
    """`DINOV2Backbone`: register tokens, SwiGLU, layer scale, interpolated positions."""
    return _image_model(
        "DINOV2Backbone", "imagenet", patch_size=8, num_register_tokens=2, use_swiglu_ffn=True,
        image_shape=(32, 32, 3), position_embedding_shape=(64, 64, 3), **_TRANSFORMER,
    )


def build_dinov3():
    """`DINOV3Backbone`: register tokens, rotary positions, a gated SiLU MLP."""
    return _image_model(
        "DINOV3Backbone", "imagenet", patch_size=8, num_register_tokens=2, use_gated_mlp=True,
        hidden_activation="silu", image_shape=(32, 32, 3), **_TRANSFORMER,
    )


def _mit():
    """A two-level MiT (the SegFormer encoder): 8x8 then 4x4 tokens, reduced keys at level one."""
    return keras_hub.models.MiTBackbone(
        layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2], layerwise_sr_ratios=[2, 1],
        max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3], layerwise_strides=[4, 2], hidden_dims=[8, 16],
        image_shape=(32, 32, 3),
    )


def build_mit():
    """`MiTBackbone`: overlapping patch embeddings, spatial-reduction attention."""
    return _fed(_mit(), images(32, "unit"))


def build_swin_transformer():
    """`SwinTransformerBackbone`: 8x8 tokens in 4x4 windows; the first stage's second block
    shifts its windows, then patch merging into the second stage."""
    return _image_model(
        "SwinTransformerBackbone", "imagenet", image_shape=(32, 32, 3), embed_dim=8, depths=(2, 1),
        num_heads=(1, 2), window_size=4, patch_size=4, mlp_ratio=2.0,
    )


def build_vit():
    """`ViTBackbone`: class token, 4x4 patches of 8."""
    return _image_model(
        "ViTBackbone", "symmetric", image_shape=(32, 32, 3), patch_size=8, num_layers=2, num_heads=2,
        hidden_dim=16, mlp_dim=32,
    )


def _vit_det():
    """A ViTDet on 32x32 images: 8x8 tokens, layer 0 in 4x4 windows, layer 1 global."""
    return keras_hub.models.ViTDetBackbone(
        hidden_size=16, num_layers=2, intermediate_dim=32, num_heads=2, global_attention_layer_indices=[1],
        image_shape=(32, 32, 3), patch_size=4, num_output_channels=8, window_size=4,
    )


def build_vit_det():
    """`ViTDetBackbone`: windowed and global attention, relative positions, a conv neck."""
    return _fed(_vit_det(), images(32, "imagenet"))


# --- Detection, segmentation and depth heads on a tiny image encoder -----------


def _resnet_vd(stem_filters=8):
    """A four-stack ResNet-vd with pyramid outputs P2-P5 for any image size.

    `_vd` blocks give the first stack a convolution shortcut, so the stem may
    be narrower than the 64 filters the first stack must have.
    """
    return keras_hub.models.ResNetBackbone(
        input_conv_filters=[stem_filters] * 3, input_conv_kernel_sizes=[3, 3, 3],
        stackwise_num_filters=[64, 8, 8, 8], stackwise_num_blocks=[1, 1, 1, 1],
        stackwise_num_strides=[1, 2, 2, 2], block_type="basic_block_vd",
    )


def build_basnet():
    """`BASNetBackbone` on a ResNet-vd: stride 32 below its input, so 32x32 is the smallest.

    Its first conv feeds the ResNet's first stack in place of the stem, so the
    projection has the stem's width (4); the decoder is 8x as wide.
    """
    return _image_model(
        "BASNetBackbone", "imagenet", image_encoder=_resnet_vd(stem_filters=4), num_classes=1,
        image_shape=(32, 32, 3), projection_filters=4,
    )


def build_deeplab_v3():
    """`DeepLabV3Backbone` on a ResNet-vd: atrous pyramid pooling on P4, P2 low-level features."""
    return _image_model(
        "DeepLabV3Backbone", "imagenet", image_encoder=_resnet_vd(), spatial_pyramid_pooling_key="P4",
        upsampling_size=4, dilation_rates=[1, 2], low_level_feature_key="P2", projection_filters=8,
        image_shape=(32, 32, 3),
    )


def build_retinanet():
    """`RetinaNetBackbone` on a ResNet-vd: the feature pyramid P3-P5 (256 filters, fixed)."""
    return _image_model(
        "RetinaNetBackbone", "imagenet", image_encoder=_resnet_vd(), min_level=3, max_level=5, use_p5=False,
        image_shape=(32, 32, 3),
    )


def build_segformer():
    """`SegFormerBackbone` on a two-level MiT."""
    return _image_model("SegFormerBackbone", "imagenet", image_encoder=_mit(), projection_filters=8)


def build_depth_anything():
    """`DepthAnythingBackbone` on a DINOv2: both layers' tokens reassembled at 2x and 1x."""
    encoder = keras_hub.models.DINOV2Backbone(
        patch_size=8, image_shape=(32, 32, 3), position_embedding_shape=(64, 64, 3), apply_layernorm=True,
        **_TRANSFORMER,
    )
    return _image_model(
        "DepthAnythingBackbone", "imagenet", image_encoder=encoder, reassemble_factors=[2, 1],
        neck_hidden_dims=[8, 16], fusion_hidden_dim=16, head_hidden_dim=8, head_in_index=-1,
        feature_keys=["stage1", "stage2"],
    )


def build_d_fine():
    """`DFineBackbone` on an HGNetV2, no denoising queries.

    HGNetV2 gives stage1 at stride 4 and stage2 at stride 8: 8x8 and 4x4 maps
    of a 32x32 image, 80 anchors for 8 queries.
    """
    encoder = keras_hub.models.HGNetV2Backbone(
        depths=[1, 1], embedding_size=16, hidden_sizes=[32, 64], stem_channels=[3, 8, 16], hidden_act="relu",
        use_learnable_affine_block=True, stackwise_stage_filters=[[16, 8, 32, 1, 1, 3], [32, 16, 64, 1, 1, 3]],
        apply_downsample=[False, True], use_lightweight_conv_block=[False, True],
        out_features=["stage1", "stage2"],
    )
    return _image_model(
        "DFineBackbone", "unit", backbone=encoder, decoder_in_channels=[16, 16], encoder_hidden_dim=16,
        num_labels=4, num_denoising=0, learn_initial_query=False, num_queries=8, anchor_image_size=(32, 32),
        feat_strides=[4, 8], num_feature_levels=2, hidden_dim=16, encoder_in_channels=[32, 64],
        encode_proj_layers=[1], num_attention_heads=2, encoder_ffn_dim=32, num_encoder_layers=1,
        hidden_expansion=0.5, depth_multiplier=0.5, eval_idx=-1, num_decoder_layers=2,
        decoder_attention_heads=2, decoder_ffn_dim=32, decoder_n_points=[2, 2], lqe_hidden_dim=8,
        num_lqe_layers=2, out_features=["stage1", "stage2"], image_shape=(32, 32, 3), seed=0,
    )


# --- Image-text models -----------------------------------------------------------


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
    "BASNetBackbone": build_basnet,
    "BLIP2Backbone": build_blip2,
    "CLIPBackbone": build_clip,
    "CSPNetBackbone": build_cspnet,
    "DFineBackbone": build_d_fine,
    "DINOV2Backbone": build_dinov2,
    "DINOV3Backbone": build_dinov3,
    "DeepLabV3Backbone": build_deeplab_v3,
    "DeiTBackbone": build_deit,
    "DenseNetBackbone": build_densenet,
    "DepthAnythingBackbone": build_depth_anything,
    "EfficientNetBackbone": build_efficientnet,
    "FluxBackbone": build_flux,
    "HGNetV2Backbone": build_hgnetv2,
    "MetaCLIP2Backbone": build_metaclip_2,
    "MiTBackbone": build_mit,
    "MobileNetBackbone": build_mobilenet,
    "MobileNetV5Backbone": build_mobilenetv5,
    "PARSeqBackbone": build_parseq,
    "PaliGemmaBackbone": build_pali_gemma,
    "ResNetBackbone": build_resnet,
    "RetinaNetBackbone": build_retinanet,
    "SAM3PromptableConceptBackbone": build_sam3,
    "SAMBackbone": build_sam,
    "SegFormerBackbone": build_segformer,
    "SigLIPBackbone": build_siglip,
    "StableDiffusion3Backbone": build_stable_diffusion_3,
    "SwinTransformerBackbone": build_swin_transformer,
    "VGGBackbone": build_vgg,
    "ViTBackbone": build_vit,
    "ViTDetBackbone": build_vit_det,
    "VideoPrismBackbone": build_video_prism,
    "XceptionBackbone": build_xception,
}
"""keras-hub backbones built tiny: vision, video and multimodal (see `tests.hub_zoo`)."""
