"""keras-hub vision backbones built tiny (see `tests.hub_zoo`; video and multimodal ones in `multimodal`).

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


BUILDERS = {
    "BASNetBackbone": build_basnet,
    "CSPNetBackbone": build_cspnet,
    "DFineBackbone": build_d_fine,
    "DINOV2Backbone": build_dinov2,
    "DINOV3Backbone": build_dinov3,
    "DeepLabV3Backbone": build_deeplab_v3,
    "DeiTBackbone": build_deit,
    "DenseNetBackbone": build_densenet,
    "DepthAnythingBackbone": build_depth_anything,
    "EfficientNetBackbone": build_efficientnet,
    "HGNetV2Backbone": build_hgnetv2,
    "MiTBackbone": build_mit,
    "MobileNetBackbone": build_mobilenet,
    "MobileNetV5Backbone": build_mobilenetv5,
    "ResNetBackbone": build_resnet,
    "RetinaNetBackbone": build_retinanet,
    "SegFormerBackbone": build_segformer,
    "SwinTransformerBackbone": build_swin_transformer,
    "VGGBackbone": build_vgg,
    "ViTBackbone": build_vit,
    "ViTDetBackbone": build_vit_det,
    "XceptionBackbone": build_xception,
}
