"""keras-hub backbones built tiny: vision, video and multimodal (see `tests.hub_zoo`).

Each builder builds one backbone under the current global dtype policy, with
hidden sizes of 8-32, one or two layers and the smallest image each class
accepts, and returns `(backbone, x)`: `x` a batch of two, drawn from a fixed
seed, valued as the model's preprocessing would give (images in [0, 1] or
normalized as the class's image converter does, token ids in [1, vocab) with
the second row padded).
"""

import keras_hub
import numpy as np

# keras-hub 0.32 does not export the VAE that StableDiffusion3Backbone needs
# (its docstring's `keras_hub.models.VAEBackbone` does not exist).
from keras_hub.src.models.vae.vae_backbone import VAEBackbone

BUILDERS = {}

_IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], "float32")
_IMAGENET_STD = np.array([0.229, 0.224, 0.225], "float32")


def _builds(name):
    """Registers the decorated builder in `BUILDERS` under `name`."""

    def register(builder):
        BUILDERS[name] = builder
        return builder

    return register


def _images(size, value_range="unit", seed=0, batch=2, frames=None):
    """A batch of images `size` x `size` x 3, float32.

    `value_range` is what the class's image converter hands the model:
    "unit" for [0, 1], "symmetric" for [-1, 1], "imagenet" for pixels in
    [0, 1] normalized by the ImageNet mean and standard deviation. With
    `frames`, a video batch `(batch, frames, size, size, 3)`.
    """
    shape = (batch, size, size, 3) if frames is None else (
        batch, frames, size, size, 3
    )
    pixels = np.random.default_rng(seed).uniform(0.0, 1.0, shape)
    pixels = pixels.astype("float32")
    if value_range == "symmetric":
        return pixels * 2.0 - 1.0
    if value_range == "imagenet":
        return (pixels - _IMAGENET_MEAN) / _IMAGENET_STD
    return pixels


def _tokens(vocabulary_size, length, seed=1, pad=2):
    """Token ids in [1, vocabulary_size) and a padding mask, batch of two.

    The second row's last `pad` positions are padding: id 0, mask 0.
    """
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(1, vocabulary_size, (2, length)).astype("int32")
    padding_mask = np.ones((2, length), "int32")
    padding_mask[1, length - pad :] = 0
    token_ids[1, length - pad :] = 0
    return token_ids, padding_mask


def _sentences(length, words, start=None, end=None, pad=0, seed=1):
    """Two packed sentences of token ids, as a CLIP-style packer gives them.

    Each row is `[start] w w ... w end pad ...` (start left out when None),
    the words drawn from the integer range `words`; the first row fills
    `length`, the second is two positions shorter and padded with `pad`.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for used in (length, length - 2):
        head = [] if start is None else [start]
        tail = [] if end is None else [end]
        count = used - len(head) - len(tail)
        row = head + list(rng.integers(*words, count)) + tail
        rows.append(row + [pad] * (length - used))
    return np.array(rows, "int32")


def _feed(backbone, images):
    """`images` keyed as the backbone's single image input is, or bare."""
    if isinstance(backbone.input, dict):
        (key,) = backbone.input
        return backbone, {key: images}
    return backbone, images


# --- Convolutional image encoders -----------------------------------------


@_builds("CSPNetBackbone")
def build_cspnet():
    backbone = keras_hub.models.CSPNetBackbone(
        stem_filters=8,
        stem_kernel_size=3,
        stem_strides=1,
        stackwise_depth=[1, 1],
        stackwise_strides=2,
        stackwise_num_filters=[8, 16],
        block_type="dark_block",
        stage_type="csp",
        down_growth=True,
        bottle_ratio=(0.5, 1.0),
        block_ratio=(1.0, 0.5),
        expand_ratio=(2.0, 1.0),
        stem_padding="same",
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "imagenet")


@_builds("DenseNetBackbone")
def build_densenet():
    backbone = keras_hub.models.DenseNetBackbone(
        stackwise_num_repeats=[1, 1],
        growth_rate=8,
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "imagenet")


@_builds("EfficientNetBackbone")
def build_efficientnet():
    backbone = keras_hub.models.EfficientNetBackbone(
        stackwise_width_coefficients=[1.0, 1.0],
        stackwise_depth_coefficients=[1.0, 1.0],
        stackwise_kernel_sizes=[3, 3],
        stackwise_num_repeats=[1, 1],
        stackwise_input_filters=[8, 8],
        stackwise_output_filters=[8, 16],
        stackwise_expansion_ratios=[1, 4],
        stackwise_squeeze_and_excite_ratios=[0.0, 0.25],
        stackwise_strides=[1, 2],
        stackwise_block_types=["fused", "unfused"],
        stackwise_force_input_filters=[0, 0],
        stackwise_nores_option=[False, False],
        num_features=32,
        input_shape=(32, 32, 3),
    )
    return backbone, _images(32, "imagenet")


@_builds("HGNetV2Backbone")
def build_hgnetv2():
    stage_filters = [[16, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3]]
    backbone = keras_hub.models.HGNetV2Backbone(
        depths=[1, 1],
        embedding_size=16,
        hidden_sizes=[16, 32],
        stem_channels=[3, 8, 16],
        hidden_act="relu",
        use_learnable_affine_block=True,
        stackwise_stage_filters=stage_filters,
        apply_downsample=[False, True],
        use_lightweight_conv_block=[False, True],
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "unit")


@_builds("MobileNetBackbone")
def build_mobilenet():
    backbone = keras_hub.models.MobileNetBackbone(
        stackwise_expansion=[[2], [4, 4]],
        stackwise_num_blocks=[1, 2],
        stackwise_num_filters=[[8], [16, 16]],
        stackwise_kernel_size=[[3], [5, 5]],
        stackwise_num_strides=[[2], [2, 1]],
        stackwise_se_ratio=[[None], [0.25, 0.25]],
        stackwise_activation=[["relu"], ["hard_swish", "hard_swish"]],
        stackwise_padding=[[1], [2, 2]],
        output_num_filters=32,
        depthwise_filters=8,
        depthwise_stride=2,
        depthwise_residual=False,
        last_layer_filter=32,
        squeeze_and_excite=0.5,
        input_num_filters=8,
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "imagenet")


@_builds("MobileNetV5Backbone")
def build_mobilenetv5():
    backbone = keras_hub.models.MobileNetV5Backbone(
        stackwise_block_types=[["er"], ["uir"], ["mqa"]],
        stackwise_num_blocks=[1, 1, 1],
        stackwise_num_filters=[[16], [16], [16]],
        stackwise_strides=[[2], [2], [1]],
        stackwise_act_layers=[["relu"], ["gelu"], ["gelu"]],
        stackwise_exp_ratios=[[2.0], [2.0], [0.0]],
        stackwise_se_ratios=[[0.0], [0.0], [0.0]],
        stackwise_dw_kernel_sizes=[[0], [3], [0]],
        stackwise_dw_start_kernel_sizes=[[0], [3], [0]],
        stackwise_dw_end_kernel_sizes=[[0], [0], [0]],
        stackwise_exp_kernel_sizes=[[3], [0], [0]],
        stackwise_pw_kernel_sizes=[[1], [0], [0]],
        stackwise_num_heads=[[0], [0], [2]],
        stackwise_key_dims=[[0], [0], [8]],
        stackwise_value_dims=[[0], [0], [8]],
        stackwise_kv_strides=[[0], [0], [2]],
        stackwise_use_cpe=[[False], [False], [False]],
        stem_size=8,
        num_features=32,
        use_msfa=True,
        msfa_indices=(-2, -1),
        msfa_output_resolution=4,
        layer_scale_init_value=1e-5,
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "symmetric")


@_builds("ResNetBackbone")
def build_resnet():
    # The first stack must have 64 filters (a check in ResNetBackbone), and
    # its first basic block adds the stem's output: the stem has 64 too.
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[7],
        stackwise_num_filters=[64, 16],
        stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        use_pre_activation=True,
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "imagenet")


@_builds("VGGBackbone")
def build_vgg():
    backbone = keras_hub.models.VGGBackbone(
        stackwise_num_repeats=[1, 1],
        stackwise_num_filters=[8, 16],
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "imagenet")


@_builds("XceptionBackbone")
def build_xception():
    backbone = keras_hub.models.XceptionBackbone(
        stackwise_conv_filters=[[8, 16], [16, 32], [32, 32]],
        stackwise_pooling=[True, True, False],
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "symmetric")


# --- Vision transformers ----------------------------------------------------


@_builds("DeiTBackbone")
def build_deit():
    backbone = keras_hub.models.DeiTBackbone(
        image_shape=(32, 32, 3),
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
    )
    return backbone, _images(32, "imagenet")


@_builds("DINOV2Backbone")
def build_dinov2():
    backbone = keras_hub.models.DINOV2Backbone(
        patch_size=8,
        num_layers=2,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        num_register_tokens=2,
        use_swiglu_ffn=True,
        image_shape=(32, 32, 3),
        position_embedding_shape=(64, 64, 3),
    )
    return backbone, _images(32, "imagenet")


@_builds("DINOV3Backbone")
def build_dinov3():
    backbone = keras_hub.models.DINOV3Backbone(
        patch_size=8,
        num_layers=2,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        num_register_tokens=2,
        use_gated_mlp=True,
        hidden_activation="silu",
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "imagenet")


@_builds("MiTBackbone")
def build_mit():
    backbone = keras_hub.models.MiTBackbone(
        layerwise_depths=[1, 1],
        num_layers=2,
        layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[2, 1],
        max_drop_path_rate=0.0,
        layerwise_patch_sizes=[7, 3],
        layerwise_strides=[4, 2],
        hidden_dims=[8, 16],
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "unit")


@_builds("SwinTransformerBackbone")
def build_swin_transformer():
    # 32 / patch 4 = 8x8 tokens, two windows of 4 a side; two blocks in the
    # first stage so the second one uses shifted windows.
    backbone = keras_hub.models.SwinTransformerBackbone(
        image_shape=(32, 32, 3),
        embed_dim=8,
        depths=(2, 1),
        num_heads=(1, 2),
        window_size=4,
        patch_size=4,
        mlp_ratio=2.0,
    )
    return backbone, _images(32, "imagenet")


@_builds("ViTBackbone")
def build_vit():
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(32, 32, 3),
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
    )
    return backbone, _images(32, "symmetric")


@_builds("ViTDetBackbone")
def build_vit_det():
    # 32 / patch 4 = 8x8 tokens: layer 0 attends in 4x4 windows, layer 1
    # globally.
    backbone = keras_hub.models.ViTDetBackbone(
        hidden_size=16,
        num_layers=2,
        intermediate_dim=32,
        num_heads=2,
        global_attention_layer_indices=[1],
        image_shape=(32, 32, 3),
        patch_size=4,
        num_output_channels=8,
        window_size=4,
    )
    return backbone, _images(32, "imagenet")


# --- Detection, segmentation and depth heads on a tiny image encoder --------


def _tiny_resnet(stem_filters=8):
    """A four-stack ResNet-vd with pyramid outputs P2-P5, any image size."""
    # `_vd` blocks give the first stack a convolution shortcut, so the stem
    # may be narrower than the 64 filters the first stack must have.
    return keras_hub.models.ResNetBackbone(
        input_conv_filters=[stem_filters] * 3,
        input_conv_kernel_sizes=[3, 3, 3],
        stackwise_num_filters=[64, 8, 8, 8],
        stackwise_num_blocks=[1, 1, 1, 1],
        stackwise_num_strides=[1, 2, 2, 2],
        block_type="basic_block_vd",
    )


@_builds("BASNetBackbone")
def build_basnet():
    # BASNet's encoder is stride 32 below its input: 32x32 is the smallest.
    # Its first conv feeds the ResNet's first stack in place of the stem, so
    # the projection has the stem's width; its decoder is 8x as wide.
    backbone = keras_hub.models.BASNetBackbone(
        image_encoder=_tiny_resnet(stem_filters=4),
        num_classes=1,
        image_shape=(32, 32, 3),
        projection_filters=4,
    )
    return backbone, _images(32, "imagenet")


@_builds("DeepLabV3Backbone")
def build_deeplab_v3():
    backbone = keras_hub.models.DeepLabV3Backbone(
        image_encoder=_tiny_resnet(),
        spatial_pyramid_pooling_key="P4",
        upsampling_size=4,
        dilation_rates=[1, 2],
        low_level_feature_key="P2",
        projection_filters=8,
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "imagenet")


@_builds("RetinaNetBackbone")
def build_retinanet():
    backbone = keras_hub.models.RetinaNetBackbone(
        image_encoder=_tiny_resnet(),
        min_level=3,
        max_level=5,
        use_p5=False,
        image_shape=(32, 32, 3),
    )
    return backbone, _images(32, "imagenet")


@_builds("SegFormerBackbone")
def build_segformer():
    encoder = keras_hub.models.MiTBackbone(
        layerwise_depths=[1, 1],
        num_layers=2,
        layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[2, 1],
        max_drop_path_rate=0.0,
        layerwise_patch_sizes=[7, 3],
        layerwise_strides=[4, 2],
        hidden_dims=[8, 16],
        image_shape=(32, 32, 3),
    )
    backbone = keras_hub.models.SegFormerBackbone(
        image_encoder=encoder, projection_filters=8
    )
    return backbone, _images(32, "imagenet")


@_builds("DepthAnythingBackbone")
def build_depth_anything():
    encoder = keras_hub.models.DINOV2Backbone(
        patch_size=8,
        num_layers=2,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        image_shape=(32, 32, 3),
        position_embedding_shape=(64, 64, 3),
        apply_layernorm=True,
    )
    backbone = keras_hub.models.DepthAnythingBackbone(
        image_encoder=encoder,
        reassemble_factors=[2, 1],
        neck_hidden_dims=[8, 16],
        fusion_hidden_dim=16,
        head_hidden_dim=8,
        head_in_index=-1,
        feature_keys=["stage1", "stage2"],
    )
    return _feed(backbone, _images(32, "imagenet"))


@_builds("DFineBackbone")
def build_d_fine():
    # HGNetV2 gives stage1 at stride 4 and stage2 at stride 8: 8x8 and 4x4
    # feature maps of a 32x32 image, 80 anchors for 8 queries.
    encoder = keras_hub.models.HGNetV2Backbone(
        depths=[1, 1],
        embedding_size=16,
        hidden_sizes=[32, 64],
        stem_channels=[3, 8, 16],
        hidden_act="relu",
        use_learnable_affine_block=True,
        stackwise_stage_filters=[[16, 8, 32, 1, 1, 3], [32, 16, 64, 1, 1, 3]],
        apply_downsample=[False, True],
        use_lightweight_conv_block=[False, True],
        out_features=["stage1", "stage2"],
    )
    backbone = keras_hub.models.DFineBackbone(
        backbone=encoder,
        decoder_in_channels=[16, 16],
        encoder_hidden_dim=16,
        num_labels=4,
        num_denoising=0,
        learn_initial_query=False,
        num_queries=8,
        anchor_image_size=(32, 32),
        feat_strides=[4, 8],
        num_feature_levels=2,
        hidden_dim=16,
        encoder_in_channels=[32, 64],
        encode_proj_layers=[1],
        num_attention_heads=2,
        encoder_ffn_dim=32,
        num_encoder_layers=1,
        hidden_expansion=0.5,
        depth_multiplier=0.5,
        eval_idx=-1,
        num_decoder_layers=2,
        decoder_attention_heads=2,
        decoder_ffn_dim=32,
        decoder_n_points=[2, 2],
        lqe_hidden_dim=8,
        num_lqe_layers=2,
        out_features=["stage1", "stage2"],
        image_shape=(32, 32, 3),
        seed=0,
    )
    return _feed(backbone, _images(32, "unit"))


# --- Image-text contrastive models ------------------------------------------


@_builds("CLIPBackbone")
def build_clip():
    vocabulary_size = 64
    vision_encoder = keras_hub.models.CLIPVisionEncoder(
        patch_size=8,
        hidden_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        image_shape=(32, 32, 3),
    )
    text_encoder = keras_hub.models.CLIPTextEncoder(
        vocabulary_size=vocabulary_size,
        embedding_dim=16,
        hidden_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        max_sequence_length=8,
    )
    backbone = keras_hub.models.CLIPBackbone(
        vision_encoder=vision_encoder,
        text_encoder=text_encoder,
        projection_dim=16,
    )
    # CLIP's vocabulary ends with its start and end tokens; the pooler takes
    # the end token as the position of the largest id. Padding is id 0.
    token_ids = _sentences(
        8,
        words=(1, vocabulary_size - 2),
        start=vocabulary_size - 2,
        end=vocabulary_size - 1,
    )
    return backbone, {"images": _images(32, "imagenet"), "token_ids": token_ids}


@_builds("MetaCLIP2Backbone")
def build_metaclip_2():
    vocabulary_size = 64
    vision_encoder = keras_hub.models.MetaCLIP2VisionEncoder(
        patch_size=8,
        hidden_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        image_shape=(32, 32, 3),
    )
    text_encoder = keras_hub.models.MetaCLIP2TextEncoder(
        vocabulary_size=vocabulary_size,
        embedding_dim=16,
        hidden_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        max_sequence_length=8,
    )
    backbone = keras_hub.models.MetaCLIP2Backbone(
        vision_encoder=vision_encoder,
        text_encoder=text_encoder,
        projection_dim=16,
    )
    # MetaCLIP 2's tokenizer: <s> 0, <pad> 1, </s> 2 (the pooler's EOS).
    token_ids = _sentences(
        8, words=(4, vocabulary_size), start=0, end=2, pad=1
    )
    return backbone, {"images": _images(32, "imagenet"), "token_ids": token_ids}


@_builds("SigLIPBackbone")
def build_siglip():
    vocabulary_size = 64
    vision_encoder = keras_hub.models.SigLIPVisionEncoder(
        patch_size=8,
        hidden_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        image_shape=(32, 32, 3),
    )
    text_encoder = keras_hub.models.SigLIPTextEncoder(
        vocabulary_size=vocabulary_size,
        embedding_dim=16,
        hidden_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        max_sequence_length=8,
    )
    backbone = keras_hub.models.SigLIPBackbone(
        vision_encoder=vision_encoder, text_encoder=text_encoder
    )
    # SigLIP pads with its end token </s> (id 1), so the last position is
    # an end token in every row ("sticky" EOS, which its text head reads).
    token_ids = _sentences(8, words=(2, vocabulary_size), end=1, pad=1)
    return backbone, {"images": _images(32, "symmetric"), "token_ids": token_ids}


# --- Vision-language models -------------------------------------------------


@_builds("PaliGemmaBackbone")
def build_pali_gemma():
    vocabulary_size = 64
    backbone = keras_hub.models.PaliGemmaBackbone(
        vocabulary_size=vocabulary_size,
        image_size=16,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
        vit_patch_size=4,
        vit_num_heads=2,
        vit_hidden_dim=16,
        vit_num_layers=2,
        vit_intermediate_dim=32,
    )
    token_ids, padding_mask = _tokens(vocabulary_size, 8)
    # A 4-token prompt (block attention) then the response (causal).
    response_mask = padding_mask.copy()
    response_mask[:, :4] = 0
    return backbone, {
        "images": _images(16, "symmetric"),
        "token_ids": token_ids,
        "padding_mask": padding_mask,
        "response_mask": response_mask,
    }


@_builds("BLIP2Backbone")
def build_blip2():
    vocabulary_size = 64
    num_query_tokens = 4
    vision_encoder = keras_hub.models.BLIP2VisionEncoder(
        image_size=16,
        patch_size=4,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        use_patch_bias=True,
        use_class_token=True,
        use_mha_bias=True,
        use_mlp_bias=True,
        dropout_rate=0.0,
        layer_norm_epsilon=1e-6,
        initializer_range=0.02,
    )
    qformer = keras_hub.models.BLIP2QFormer(
        num_query_tokens=num_query_tokens,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        vision_dim=16,
        cross_attention_frequency=1,
        dropout=0.0,
        layer_norm_epsilon=1e-6,
    )
    language_model = keras_hub.models.BLIP2CustomOPT(
        vocabulary_size=vocabulary_size,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        num_query_tokens=num_query_tokens,
        dropout=0.0,
        max_sequence_length=16,
        qformer_hidden_dim=16,
    )
    backbone = keras_hub.models.BLIP2Backbone(
        vision_encoder=vision_encoder,
        qformer=qformer,
        language_model=language_model,
    )
    token_ids, padding_mask = _tokens(vocabulary_size, 8)
    return backbone, {
        "images": _images(16, "imagenet"),
        "token_ids": token_ids,
        "padding_mask": padding_mask,
    }


@_builds("PARSeqBackbone")
def build_parseq():
    # PARSeq's vocabulary: [E] 0 (end), the characters, [B] (start), [P]
    # (padding) last. A label of at most `max_label_length` characters is
    # packed as [B] c ... c [E] [P] ..., one position longer than the label.
    vocabulary_size = 16
    max_label_length = 6
    start, pad = vocabulary_size - 2, vocabulary_size - 1
    image_encoder = keras_hub.models.ViTBackbone(
        image_shape=(16, 32, 3),
        patch_size=(4, 8),
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        use_class_token=False,
    )
    backbone = keras_hub.models.PARSeqBackbone(
        image_encoder=image_encoder,
        vocabulary_size=vocabulary_size,
        max_label_length=max_label_length,
        decoder_hidden_dim=16,
        num_decoder_layers=1,
        num_decoder_heads=2,
        decoder_mlp_dim=32,
    )
    token_ids = _sentences(
        max_label_length + 1, words=(1, start), start=start, end=0, pad=pad
    )
    padding_mask = (token_ids != pad).astype("int32")
    images = np.random.default_rng(0).uniform(-1.0, 1.0, (2, 16, 32, 3))
    return backbone, {
        "images": images.astype("float32"),
        "token_ids": token_ids,
        "padding_mask": padding_mask,
    }


@_builds("VideoPrismBackbone")
def build_video_prism():
    # The video-text variant: factorized space-time encoder, attention
    # pooling, and a causal text encoder over padded token ids.
    vocabulary_size = 64
    backbone = keras_hub.models.VideoPrismBackbone(
        num_frames=2,
        patch_size=8,
        hidden_dim=16,
        intermediate_dim=32,
        num_heads=2,
        num_spatial_layers=1,
        num_temporal_layers=1,
        num_auxiliary_layers=1,
        vocabulary_size=vocabulary_size,
        num_text_layers=1,
        image_shape=(16, 16, 3),
    )
    token_ids, padding_mask = _tokens(vocabulary_size, 8)
    return backbone, {
        "pixel_values": _images(16, "unit", frames=2),
        "token_ids": token_ids,
        "padding_mask": padding_mask,
    }


# --- Promptable segmentation ------------------------------------------------


@_builds("SAMBackbone")
def build_sam():
    # ViTDet on 32x32 images with patch 4: an 8x8 image embedding.
    image_encoder = keras_hub.models.ViTDetBackbone(
        hidden_size=16,
        num_layers=2,
        intermediate_dim=32,
        num_heads=2,
        global_attention_layer_indices=[1],
        image_shape=(32, 32, 3),
        patch_size=4,
        num_output_channels=8,
        window_size=4,
    )
    prompt_encoder = keras_hub.layers.SAMPromptEncoder(
        hidden_size=8,
        image_embedding_size=(8, 8),
        input_image_size=(32, 32),
        mask_in_channels=16,
    )
    mask_decoder = keras_hub.layers.SAMMaskDecoder(
        num_layers=2,
        hidden_size=8,
        intermediate_dim=16,
        num_heads=2,
        embedding_dim=8,
        num_multimask_outputs=3,
        iou_head_depth=2,
        iou_head_hidden_dim=8,
    )
    backbone = keras_hub.models.SAMBackbone(
        image_encoder=image_encoder,
        prompt_encoder=prompt_encoder,
        mask_decoder=mask_decoder,
    )
    # Two clicks in pixel coordinates: foreground and background, the second
    # image's second click padding (label -1); one box (corners) each; no
    # mask prompt (zero masks, as SAM's preprocessor sends).
    points = np.array([[[8.0, 10.0], [20.0, 24.0]], [[16.0, 5.0], [0.0, 0.0]]])
    labels = np.array([[1.0, 0.0], [1.0, -1.0]])
    boxes = np.array(
        [[[[4.0, 4.0], [28.0, 30.0]]], [[[10.0, 2.0], [22.0, 16.0]]]]
    )
    return backbone, {
        "images": _images(32, "imagenet"),
        "points": points.astype("float32"),
        "labels": labels.astype("float32"),
        "boxes": boxes.astype("float32"),
        "masks": np.zeros((2, 0, 32, 32, 1), "float32"),
    }


@_builds("SAM3PromptableConceptBackbone")
def build_sam3():
    # 32x32 images, patch 4: an 8x8 grid; the FPN's 4x, 2x and 1x levels
    # feed the three upsampling stages of the mask decoder.
    vocabulary_size = 64
    image_shape = (32, 32, 3)
    vision_encoder = keras_hub.layers.SAM3VisionEncoder(
        image_shape=image_shape,
        patch_size=4,
        num_layers=2,
        hidden_dim=16,
        intermediate_dim=32,
        num_heads=2,
        fpn_hidden_dim=16,
        fpn_scale_factors=[4.0, 2.0, 1.0, 0.5],
        pretrain_image_shape=(16, 16, 3),
        window_size=2,
        global_attn_indexes=[1],
    )
    text_encoder = keras_hub.layers.SAM3TextEncoder(
        vocabulary_size=vocabulary_size,
        embedding_dim=16,
        hidden_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        max_sequence_length=8,
    )
    geometry_encoder = keras_hub.layers.SAM3GeometryEncoder(
        num_layers=1, hidden_dim=16, intermediate_dim=32, num_heads=2, roi_size=2
    )
    detr_encoder = keras_hub.layers.SAM3DetrEncoder(
        num_layers=1, hidden_dim=16, intermediate_dim=32, num_heads=2
    )
    detr_decoder = keras_hub.layers.SAM3DetrDecoder(
        image_shape=image_shape,
        patch_size=4,
        num_layers=2,
        hidden_dim=16,
        intermediate_dim=32,
        num_heads=2,
        num_queries=8,
    )
    mask_decoder = keras_hub.layers.SAM3MaskDecoder(
        num_upsampling_stages=3, hidden_dim=16, num_heads=2
    )
    backbone = keras_hub.models.SAM3PromptableConceptBackbone(
        vision_encoder=vision_encoder,
        text_encoder=text_encoder,
        geometry_encoder=geometry_encoder,
        detr_encoder=detr_encoder,
        detr_decoder=detr_decoder,
        mask_decoder=mask_decoder,
    )
    # The text prompt is packed CLIP-style and padded with the end token.
    start, end = vocabulary_size - 2, vocabulary_size - 1
    token_ids = _sentences(8, words=(1, start), start=start, end=end, pad=end)
    padding_mask = np.ones_like(token_ids)
    padding_mask[1, -2:] = 0
    # Box prompts as the preprocessor sends them: [batch index, cx, cy, w, h]
    # in [0, 1], one positive box (label 1) per image. keras-hub 0.32's
    # backbone hands the geometry encoder the labels as the box mask and the
    # mask as the labels, so a padding box (label -10) crashes and a negative
    # box (label 0) is read as padding: neither is sent.
    boxes = np.array(
        [[[0, 0.5, 0.5, 0.4, 0.6]], [[1, 0.4, 0.6, 0.5, 0.3]]], "float32"
    )
    box_labels = np.ones((2, 1), "int32")
    return backbone, {
        "pixel_values": _images(32, "symmetric"),
        "token_ids": token_ids,
        "padding_mask": padding_mask,
        "boxes": boxes,
        "box_labels": box_labels,
    }


# --- Diffusion ---------------------------------------------------------------


@_builds("StableDiffusion3Backbone")
def build_stable_diffusion_3():
    # 32x32 images, a VAE of stride 8 (its group norms need multiples of 32
    # filters): 4x4x16 latents, 2x2 patches of 2 for the MMDiT. SD3.5's
    # RMS-normed queries and keys and a dual-attention first layer included.
    vocabulary_size = 64
    vae = VAEBackbone(
        encoder_num_filters=[32, 32, 32, 32],
        encoder_num_blocks=[1, 1, 1, 1],
        decoder_num_filters=[32, 32, 32, 32],
        decoder_num_blocks=[1, 1, 1, 1],
        sampler_method="mode",
    )
    # SD3 reads each CLIP's penultimate layer (intermediate_output_index).
    clip_l = keras_hub.models.CLIPTextEncoder(
        vocabulary_size=vocabulary_size,
        embedding_dim=16,
        hidden_dim=16,
        num_layers=2,
        num_heads=2,
        intermediate_dim=32,
        intermediate_output_index=-2,
        max_sequence_length=8,
        name="clip_l",
    )
    clip_g = keras_hub.models.CLIPTextEncoder(
        vocabulary_size=vocabulary_size,
        embedding_dim=32,
        hidden_dim=32,
        num_layers=2,
        num_heads=2,
        intermediate_dim=64,
        intermediate_activation="gelu",
        intermediate_output_index=-2,
        max_sequence_length=8,
        name="clip_g",
    )
    backbone = keras_hub.models.StableDiffusion3Backbone(
        mmdit_patch_size=2,
        mmdit_hidden_dim=16,
        mmdit_num_layers=2,
        mmdit_num_heads=2,
        mmdit_position_size=4,
        mmdit_qk_norm="rms_norm",
        mmdit_dual_attention_indices=(0,),
        vae=vae,
        clip_l=clip_l,
        clip_g=clip_g,
        image_shape=(32, 32, 3),
    )
    # CLIP-style prompts (start, words, end; CLIP-L pads with its end token,
    # CLIP-G with 0) and the empty negative prompt.
    start, end = vocabulary_size - 2, vocabulary_size - 1
    words = (1, start)
    prompt_l = _sentences(8, words, start=start, end=end, pad=end)
    prompt_g = _sentences(8, words, start=start, end=end, pad=0)
    empty_l = np.array([[start, end] + [end] * 6] * 2, "int32")
    empty_g = np.array([[start, end] + [0] * 6] * 2, "int32")
    latents = np.random.default_rng(2).standard_normal((2, 4, 4, 16))
    return backbone, {
        "images": _images(32, "symmetric"),
        "latents": latents.astype("float32"),
        "clip_l_token_ids": prompt_l,
        "clip_l_negative_token_ids": empty_l,
        "clip_g_token_ids": prompt_g,
        "clip_g_negative_token_ids": empty_g,
        "num_steps": np.full((2,), 4, "int32"),
        "guidance_scale": np.full((2,), 7.0, "float32"),
    }


@_builds("FluxBackbone")
def build_flux():
    # Flux takes packed latents: a 4x4x4 latent in 2x2 patches is 4 tokens of
    # 16 channels, each with its (0, row, column) position id; text tokens
    # (T5 outputs) have position ids 0; `y` is CLIP's pooled embedding;
    # timesteps are in [0, 1]. axes_dim splits the head dim (8) for RoPE.
    rng = np.random.default_rng(3)
    backbone = keras_hub.models.FluxBackbone(
        input_channels=16,
        hidden_size=16,
        mlp_ratio=2.0,
        num_heads=2,
        depth=1,
        depth_single_blocks=1,
        axes_dim=[2, 2, 4],
        theta=10_000,
        use_bias=True,
        guidance_embed=True,
        image_shape=(4, 16),
        text_shape=(6, 16),
        image_ids_shape=(4, 3),
        text_ids_shape=(6, 3),
        y_shape=(8,),
    )
    rows, columns = np.meshgrid(np.arange(2), np.arange(2), indexing="ij")
    position = np.stack([np.zeros(4), rows.ravel(), columns.ravel()], axis=-1)
    image_ids = np.broadcast_to(position, (2, 4, 3))
    return backbone, {
        "image": rng.standard_normal((2, 4, 16)).astype("float32"),
        "image_ids": image_ids.astype("float32"),
        "text": (0.5 * rng.standard_normal((2, 6, 16))).astype("float32"),
        "text_ids": np.zeros((2, 6, 3), "float32"),
        "y": rng.standard_normal((2, 8)).astype("float32"),
        "timesteps": np.array([0.25, 0.75], "float32"),
        "guidance": np.full((2,), 3.5, "float32"),
    }
