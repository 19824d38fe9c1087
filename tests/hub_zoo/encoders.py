"""keras-hub backbones built tiny: encoders (see `tests.hub_zoo`).

Text encoders (BERT and its kin), sequence-to-sequence backbones (BART, T5,
T5Gemma, EdRec) and the audio ones (Whisper, Moonshine). Every builder takes
no arguments, builds under the current global dtype policy and returns
`(backbone, x)`: a batch of two, keyed as `backbone.input`, where the second
row is padded (token id 0 past its length, padding mask 0 there) and the
first is not. Audio is a synthetic tone at speech-like amplitude; Whisper's
features come from keras-hub's own `WhisperAudioConverter`.
"""

import inspect

import keras_hub
import numpy as np

BUILDERS = {}

VOCAB = 64
SEQ = 8
DECODER_SEQ = 6
SAMPLING_RATE = 16000


def _register(name):
    """Adds the decorated builder to `BUILDERS` under `name`."""

    def add(builder):
        BUILDERS[name] = builder
        return builder

    return add


def _tokens(seed, length=SEQ, vocab=VOCAB, padded=3):
    """Token ids in [1, vocab) and a padding mask; row 1 ends in `padded` pads.

    Returns:
        `(token_ids, padding_mask)`, int32 arrays shaped `(2, length)`;
        padded positions hold token id 0 and mask 0, as keras-hub's
        preprocessors give them.
    """
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, size=(2, length)).astype("int32")
    mask = np.ones((2, length), "int32")
    mask[1, length - padded :] = 0
    return ids * mask, mask


def _segments(mask):
    """Segment ids of a sentence pair: 0 for the first half, 1 after, 0 on pads."""
    segments = np.zeros_like(mask)
    segments[:, mask.shape[1] // 2 :] = 1
    return segments * mask


def _seq2seq(seed):
    """Encoder and decoder tokens with their padding masks (a dict)."""
    enc_ids, enc_mask = _tokens(seed)
    dec_ids, dec_mask = _tokens(seed + 1, length=DECODER_SEQ, padded=2)
    return {
        "encoder_token_ids": enc_ids,
        "encoder_padding_mask": enc_mask,
        "decoder_token_ids": dec_ids,
        "decoder_padding_mask": dec_mask,
    }


def _waveforms(seed, samples, voiced):
    """Two waveforms in [-1, 1]: row 0 a full tone, row 1 silent after `voiced`."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / SAMPLING_RATE
    tone = 0.3 * np.sin(2 * np.pi * 220.0 * t) + 0.1 * np.sin(2 * np.pi * 660.0 * t)
    audio = np.stack([tone, 0.5 * tone]) + 0.01 * rng.standard_normal((2, samples))
    audio[1, voiced:] = 0.0
    return audio.astype("float32")


def _batch(backbone, arrays):
    """`arrays` cast to the dtypes of `backbone.input`, checked to have its keys."""
    specs = backbone.input
    if set(specs) != set(arrays):
        raise KeyError(
            f"Received inputs {sorted(arrays)}; {type(backbone).__name__} "
            f"takes {sorted(specs)}."
        )
    return {key: np.asarray(arrays[key], specs[key].dtype) for key in specs}


TEXT_INPUTS = ("token_ids", "segment_ids", "padding_mask")


def _without_dropout(cls, config):
    """`config` with every dropout rate `cls` takes at 0: a training step is then the same twice."""
    for name in inspect.signature(cls.__init__).parameters:
        if "dropout" in name:
            config.setdefault(name, 0.0)
    return config


def _encoder(cls, seed, inputs=TEXT_INPUTS, **config):
    """A text encoder `cls(**config)` (no dropout) and a batch of the `inputs` it takes."""
    backbone = cls(**_without_dropout(cls, config))
    ids, mask = _tokens(seed)
    arrays = {"token_ids": ids, "segment_ids": _segments(mask), "padding_mask": mask}
    return backbone, _batch(backbone, {key: arrays[key] for key in inputs})


def _bert_like(cls, seed, inputs=TEXT_INPUTS, **config):
    """A one-layer encoder of the BERT family: 2 heads, width 16, 16 positions."""
    config = {"num_layers": 1, "num_heads": 2, "hidden_dim": 16, "intermediate_dim": 32,
              "vocabulary_size": VOCAB, "max_sequence_length": 16, **config}
    return _encoder(cls, seed, inputs, **config)


NO_SEGMENTS = ("token_ids", "padding_mask")
NO_MASK = ("token_ids", "segment_ids")


@_register("BertBackbone")
def build_bert():
    """BERT: token ids, segment ids of a sentence pair, a padding mask."""
    return _bert_like(keras_hub.models.BertBackbone, 1)


@_register("RobertaBackbone")
def build_roberta():
    """RoBERTa: token ids and a padding mask."""
    return _bert_like(keras_hub.models.RobertaBackbone, 2, NO_SEGMENTS)


@_register("XLMRobertaBackbone")
def build_xlm_roberta():
    """XLM-RoBERTa: token ids and a padding mask."""
    return _bert_like(keras_hub.models.XLMRobertaBackbone, 3, NO_SEGMENTS)


@_register("DistilBertBackbone")
def build_distil_bert():
    """DistilBERT: token ids and a padding mask."""
    return _bert_like(keras_hub.models.DistilBertBackbone, 4, NO_SEGMENTS)


@_register("DebertaV3Backbone")
def build_deberta_v3():
    """DeBERTa-v3: disentangled relative attention over 8 position buckets."""
    return _bert_like(keras_hub.models.DebertaV3Backbone, 5, NO_SEGMENTS, bucket_size=8)


@_register("AlbertBackbone")
def build_albert():
    """ALBERT: two layers sharing one group's weights, embeddings factorized to 8."""
    return _bert_like(keras_hub.models.AlbertBackbone, 6, num_layers=2, embedding_dim=8,
                      num_groups=1, num_inner_repetitions=1)


@_register("ElectraBackbone")
def build_electra():
    """ELECTRA: embeddings of width 8 projected to the hidden width 16."""
    sizes = dict(num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32)
    return _encoder(keras_hub.models.ElectraBackbone, 7, vocab_size=VOCAB, embedding_dim=8,
                    max_sequence_length=16, **sizes)


@_register("FNetBackbone")
def build_f_net():
    """FNet: Fourier token mixing, no attention and no padding mask."""
    return _encoder(keras_hub.models.FNetBackbone, 8, NO_MASK, vocabulary_size=VOCAB,
                    num_layers=1, hidden_dim=16, intermediate_dim=32,
                    max_sequence_length=16)


@_register("RoformerV2Backbone")
def build_roformer_v2():
    """RoFormer-v2: rotary positions; the mask is read from token id 0."""
    return _encoder(keras_hub.models.RoformerV2Backbone, 9, NO_MASK, vocabulary_size=VOCAB,
                    num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
                    head_size=8)


@_register("XLNetBackbone")
def build_xlnet():
    """XLNet: relative two-stream attention; token ids, padding mask, segment ids."""
    return _encoder(keras_hub.models.XLNetBackbone, 10, vocabulary_size=VOCAB,
                    num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32)


@_register("ESMBackbone")
def build_esm():
    """ESM-1 layout: learned absolute positions and a layer norm on the embeddings."""
    return _bert_like(keras_hub.models.ESMBackbone, 11, ("token_ids",),
                      use_pre_layer_norm=True, position_embedding_type="absolute")


@_register("ESM2Backbone")
def build_esm2():
    """ESM-2 layout (the class's defaults): rotary positions, mask from token id 0."""
    return _bert_like(keras_hub.models.ESM2Backbone, 12, ("token_ids",))


@_register("BartBackbone")
def build_bart():
    """BART: one encoder and one decoder layer with learned positions."""
    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16, dropout=0.0,
    )
    return backbone, _batch(backbone, _seq2seq(13))


@_register("T5Backbone")
def build_t5():
    """T5: relative position buckets, gated FFN, tied embeddings."""
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, key_value_dim=8, dropout=0.0,
    )
    return backbone, _batch(backbone, _seq2seq(15))


@_register("EdRecBackbone")
def build_edrec():
    """EdRec: RMS-normed encoder-decoder over one shared embedding."""
    backbone = keras_hub.models.EdRecBackbone(
        vocab_size=VOCAB, num_layers_enc=1, num_layers_dec=1, hidden_dim=16,
        intermediate_dim=32, num_heads=2,
    )
    return backbone, _batch(backbone, _seq2seq(17))


def _t5gemma_config():
    """Two layers per stack, one sliding-window (4) and one full, grouped-query (2:1)."""
    half = {"hidden_dim": 16, "intermediate_dim": 32, "num_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "layer_types": ["sliding_attention", "full_attention"]}
    config = {f"{stack}_{key}": value for stack in ("encoder", "decoder")
              for key, value in half.items()}
    return dict(vocabulary_size=VOCAB, sliding_window=4, query_pre_attn_scalar=8.0,
                **config)


@_register("T5GemmaBackbone")
def build_t5gemma():
    """T5Gemma: Gemma-2 blocks as encoder and decoder, with its logit softcaps."""
    backbone = keras_hub.models.T5GemmaBackbone(
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **_t5gemma_config()
    )
    return backbone, _batch(backbone, _seq2seq(19))


@_register("T5Gemma2Backbone")
def build_t5gemma2():
    """T5Gemma2, text only (no `vision_encoder`): Gemma-3 blocks with Q/K norms."""
    backbone = keras_hub.models.T5Gemma2Backbone(**_t5gemma_config())
    return backbone, _batch(backbone, _seq2seq(21))


@_register("WhisperBackbone")
def build_whisper():
    """Whisper on one second of audio: 100 log-mel frames (16 mels) and 6 tokens."""
    num_mels = 16
    backbone = keras_hub.models.WhisperBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, num_mels=num_mels, max_encoder_sequence_length=100,
        max_decoder_sequence_length=16,
    )
    # Whisper's own feature extraction; float32 whatever the global policy.
    converter = keras_hub.layers.WhisperAudioConverter(
        num_mels=num_mels, max_audio_length=1, dtype="float32"
    )
    audio = _waveforms(23, SAMPLING_RATE, voiced=SAMPLING_RATE * 6 // 10)
    dec_ids, dec_mask = _tokens(24, length=DECODER_SEQ, padded=2)
    arrays = {"encoder_features": np.asarray(converter(audio)),
              "decoder_token_ids": dec_ids, "decoder_padding_mask": dec_mask}
    return backbone, _batch(backbone, arrays)


@_register("MoonshineBackbone")
def build_moonshine():
    """Moonshine on a quarter second of raw 16 kHz audio (9 encoder frames)."""
    backbone = keras_hub.models.MoonshineBackbone(
        vocabulary_size=VOCAB, filter_dim=16, encoder_num_layers=1,
        decoder_num_layers=1, hidden_dim=16, intermediate_dim=32, encoder_num_heads=2,
        decoder_num_heads=2, max_position_embeddings=64,
    )
    # Row 1 is 3000 samples of audio, then zeros with the mask False.
    samples, voiced = SAMPLING_RATE // 4, 3000
    audio_mask = np.ones((2, samples), bool)
    audio_mask[1, voiced:] = False
    dec_ids, dec_mask = _tokens(26, length=DECODER_SEQ, padded=2)
    arrays = {
        "encoder_input_values": _waveforms(25, samples, voiced)[..., None],
        "encoder_padding_mask": audio_mask,
        "decoder_token_ids": dec_ids,
        "decoder_padding_mask": dec_mask,
    }
    return backbone, _batch(backbone, arrays)
