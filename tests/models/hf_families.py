"""Tiny random configurations of many Hugging Face families, one model file for all of them:
`--config NAME` picks one (tests/test_families.py runs the whole chain on each).

Causal LMs return their logits (next-token loss); encoder-decoders theirs for the decoder's
ids (the second input); encoders, speech encoders and image models their classification
logits, CLIP its image-text similarities (a made-up label per sample). Nothing is downloaded.
"""

import torch
import torch.nn.functional as F
import transformers
from torch import nn

VOCAB, SEQ, LABELS = 96, 12, 5
_LAYERS = {"num_hidden_layers": 2, "num_attention_heads": 4}
_DECODER = {"hidden_size": 32, "intermediate_size": 64, "vocab_size": VOCAB, **_LAYERS}

CAUSAL = {
    "bloom": ("bloom", {"hidden_size": 32, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB}),
    "falcon-7b-style": ("falcon", {"hidden_size": 32, "vocab_size": VOCAB, **_LAYERS,
                                   "new_decoder_architecture": False}),
    "gptj": ("gptj", {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB,
                      "rotary_dim": 4, "n_positions": 64}),
    "gemma": ("gemma", {**_DECODER, "num_key_value_heads": 1, "head_dim": 8}),
    "gemma2": ("gemma2", {**_DECODER, "num_key_value_heads": 2, "head_dim": 8,
                          "sliding_window": 8}),
    "phi3": ("phi3", {**_DECODER, "num_key_value_heads": 2, "pad_token_id": 0}),
    "stablelm": ("stablelm", {**_DECODER, "num_key_value_heads": 2}),
    "gpt-bigcode": ("gpt_bigcode", {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB,
                                    "n_positions": 64, "multi_query": True}),
    "codegen": ("codegen", {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": VOCAB,
                            "rotary_dim": 4, "n_positions": 64, "n_ctx": 64}),
    "olmo": ("olmo", {**_DECODER, "pad_token_id": 0}),
    "granite": ("granite", {**_DECODER, "num_key_value_heads": 2}),
    "starcoder2": ("starcoder2", {**_DECODER, "num_key_value_heads": 2}),
    "qwen3": ("qwen3", {**_DECODER, "num_key_value_heads": 2, "head_dim": 8}),
    "mixtral": ("mixtral", {**_DECODER, "num_key_value_heads": 2, "num_local_experts": 4,
                            "num_experts_per_tok": 2}),
    "xglm": ("xglm", {"d_model": 32, "ffn_dim": 64, "num_layers": 2, "attention_heads": 4,
                      "vocab_size": VOCAB, "max_position_embeddings": 64}),
    "biogpt": ("biogpt", {**_DECODER, "max_position_embeddings": 64}),
    "mpt": ("mpt", {"d_model": 32, "n_layers": 2, "n_heads": 4, "vocab_size": VOCAB,
                    "max_seq_len": 64}),
    "cohere": ("cohere", {**_DECODER, "num_key_value_heads": 2}),
    "qwen2": ("qwen2", {**_DECODER, "num_key_value_heads": 2}),
    "mistral": ("mistral", {**_DECODER, "num_key_value_heads": 2, "sliding_window": 8}),
    "phi": ("phi", {**_DECODER, "partial_rotary_factor": 0.5}),
    "gpt-neo": ("gpt_neo", {"hidden_size": 32, "num_layers": 2, "num_heads": 4,
                            "attention_types": [[["global", "local"], 1]], "window_size": 8,
                            "vocab_size": VOCAB, "max_position_embeddings": 64}),
    "persimmon": ("persimmon", {**_DECODER}),
    "qwen2-moe": ("qwen2_moe", {**_DECODER, "num_key_value_heads": 2, "num_experts": 4,
                                "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                "shared_expert_intermediate_size": 32}),
    "olmoe": ("olmoe", {**_DECODER, "num_experts": 4, "num_experts_per_tok": 2}),
    "nemotron": ("nemotron", {**_DECODER, "num_key_value_heads": 2}),
    "glm": ("glm", {**_DECODER, "num_key_value_heads": 2, "head_dim": 8, "pad_token_id": 0}),
    "recurrent-gemma": ("recurrent_gemma", {"hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": VOCAB,
                        "lru_width": 32, "attention_window_size": 8,
                        "block_types": ["recurrent", "attention"], "head_dim": 8}),
}
ENCODERS = {
    "distilbert": {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "vocab_size": VOCAB,
                   "max_position_embeddings": 64},
    "roberta": {**_DECODER, "max_position_embeddings": 64},
    "albert": {**_DECODER, "embedding_size": 16},
    "electra": {**_DECODER, "embedding_size": 16},
    "xlm-roberta": {**_DECODER, "max_position_embeddings": 64},
    "mpnet": {**_DECODER},
    "funnel": {"d_model": 32, "n_head": 4, "d_head": 8, "d_inner": 64, "block_sizes": [1, 1],
               "vocab_size": VOCAB},
    "modernbert": {**_DECODER, "pad_token_id": 0, "global_attn_every_n_layers": 2,
                   "local_attention": 8},
    "big_bird": {**_DECODER, "attention_type": "original_full"},
    "rembert": {**_DECODER, "input_embedding_size": 16, "output_embedding_size": 16},
    "megatron-bert": {**_DECODER},
    "roformer": {**_DECODER, "embedding_size": 32},
    "canine": {**_DECODER, "num_hash_buckets": 64, "downsampling_rate": 2},
}
VISION = {
    "vit": {"hidden_size": 32, "intermediate_size": 64, **_LAYERS, "image_size": 16,
            "patch_size": 4},
    "convnext": {"hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 2, 1], "image_size": 32},
    "swin": {"embed_dim": 8, "depths": [1, 2], "num_heads": [2, 4], "image_size": 32,
             "patch_size": 4, "window_size": 4},
    "resnet": {"embedding_size": 8, "hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1]},
    "mobilenet_v2": {"image_size": 32, "depth_multiplier": 0.35},
    "regnet": {"embedding_size": 8, "hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1],
               "groups_width": 8},
    "efficientnet": {"image_size": 32, "width_coefficient": 0.25, "depth_coefficient": 0.2,
                     "hidden_dim": 320},
    "beit": {"hidden_size": 32, "intermediate_size": 64, **_LAYERS, "image_size": 16,
             "patch_size": 4, "use_relative_position_bias": True},
    "dinov2": {"hidden_size": 32, "mlp_ratio": 2, **_LAYERS, "image_size": 16, "patch_size": 4},
    "poolformer": {"hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1], "image_size": 32},
    "convnextv2": {"hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 2, 1], "image_size": 32},
    "bit": {"embedding_size": 8, "hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1],
            "num_groups": 4},
    "swinv2": {"embed_dim": 8, "depths": [1, 2], "num_heads": [2, 4], "image_size": 32,
               "patch_size": 4, "window_size": 4},
    "segformer": {"hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1],
                  "num_attention_heads": [1, 1, 2, 2], "decoder_hidden_size": 16,
                  "image_size": 32},
    "data2vec-vision": {"hidden_size": 32, "intermediate_size": 64, **_LAYERS, "image_size": 16,
                        "patch_size": 4},
    "focalnet": {"embed_dim": 8, "depths": [1, 1], "image_size": 32, "patch_size": 4},
    "mobilevit": {"image_size": 32, "hidden_sizes": [16, 24, 32],
                  "neck_hidden_sizes": [8, 8, 16, 16, 24, 24, 32]},
}
# encoder-decoders: the decoder's ids are the second input. Their LayerDrop probabilities are
# 0 (transformers' default; atomc refuses any other, see atomc.trace.frontends)
_BART_LIKE = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1,
              "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
              "decoder_ffn_dim": 64, "vocab_size": VOCAB, "max_position_embeddings": 64,
              "pad_token_id": 1, "decoder_start_token_id": 2, "encoder_layerdrop": 0.0,
              "decoder_layerdrop": 0.0}
_T5_LIKE = {"vocab_size": VOCAB, "d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 4,
            "d_kv": 8}
SEQ2SEQ = {"bart": _BART_LIKE, "marian": _BART_LIKE, "pegasus": _BART_LIKE, "mbart": _BART_LIKE,
           "blenderbot-small": _BART_LIKE, "m2m_100": _BART_LIKE, "plbart": _BART_LIKE,
           "mt5": _T5_LIKE, "umt5": _T5_LIKE}
# speech encoders over raw audio (a convolutional feature extractor, then attention)
_SPEECH = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 64, "conv_dim": [16, 16], "conv_stride": [5, 4],
           "conv_kernel": [10, 8], "num_conv_pos_embeddings": 16,
           "num_conv_pos_embedding_groups": 2, "mask_time_prob": 0.0, "layerdrop": 0.0}
AUDIO = {"wav2vec2": _SPEECH, "hubert": _SPEECH, "data2vec-audio": _SPEECH, "sew": _SPEECH,
         "unispeech": _SPEECH, "wavlm": _SPEECH}
ENCODERS.update({
    "xlnet": {"d_model": 32, "n_layer": 2, "n_head": 4, "d_inner": 64, "vocab_size": VOCAB},
    "squeezebert": {**_DECODER, "embedding_size": 32, "q_groups": 2, "k_groups": 2,
                    "v_groups": 2, "post_attention_groups": 2, "intermediate_groups": 2,
                    "output_groups": 2},
    "layoutlm": {**_DECODER}, "ernie": {**_DECODER}, "mra": {**_DECODER},
    "fnet": {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
             "vocab_size": VOCAB},
    "esm": {**_DECODER, "pad_token_id": 1, "mask_token_id": 2,
            "position_embedding_type": "rotary"},
    "convbert": {**_DECODER}, "luke": {**_DECODER},
})
VISION.update({
    "pvt": {"image_size": 32, "hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1],
            "num_attention_heads": [1, 1, 2, 2]},
    "mobilevitv2": {"image_size": 64, "width_multiplier": 0.25},
    "vit_msn": {"hidden_size": 32, "intermediate_size": 64, **_LAYERS, "image_size": 16,
                "patch_size": 4},
    "hiera": {"embed_dim": 8, "depths": [1, 1, 1, 1], "num_heads": [1, 1, 1, 1],
              "image_size": [64, 64], "patch_stride": [4, 4], "masked_unit_size": [8, 8],
              "query_stride": [2, 2]},
})
# video classifiers: (batch, frames, channels, height, width)
_VIDEO = {"hidden_size": 32, "intermediate_size": 64, **_LAYERS, "image_size": 16,
          "num_frames": 4}
VIDEO = {"vivit": {**_VIDEO, "tubelet_size": [2, 4, 4]}, "timesformer": {**_VIDEO, "patch_size": 4}}


_FEATURES_SEQ2SEQ = {"vocab_size": VOCAB, "encoder_layers": 1, "decoder_layers": 1,
                     "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                     "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_model": 32,
                     "max_target_positions": 32, "pad_token_id": 1, "decoder_start_token_id": 2}
_t = transformers
# families whose head the Auto classes do not pick from a bare config, or whose inputs are
# their own (log-mel features, pixel ids): name -> () -> (kind, model)
OTHERS = {
    "clip": lambda: ("clip", _t.CLIPModel(_t.CLIPConfig(
        text_config={**_DECODER, "max_position_embeddings": 64, "bos_token_id": 0,
                     "eos_token_id": 2},
        vision_config={"hidden_size": 32, "intermediate_size": 64, **_LAYERS, "image_size": 16,
                       "patch_size": 4}, projection_dim=16))),
    "whisper": lambda: ("features", _t.WhisperForConditionalGeneration(_t.WhisperConfig(
        **_FEATURES_SEQ2SEQ, num_mel_bins=8, max_source_positions=16, bos_token_id=2,
        eos_token_id=3))),
    "speech_to_text": lambda: ("features", _t.Speech2TextForConditionalGeneration(
        _t.Speech2TextConfig(**_FEATURES_SEQ2SEQ, input_feat_per_channel=8, input_channels=1,
                             max_source_positions=64, conv_channels=16, encoder_layerdrop=0.0,
                             decoder_layerdrop=0.0))),
    "deit": lambda: ("image", _t.DeiTForImageClassification(_t.DeiTConfig(
        hidden_size=32, intermediate_size=64, **_LAYERS, image_size=16, patch_size=4,
        num_labels=LABELS))),
    "levit": lambda: ("image", _t.LevitForImageClassification(_t.LevitConfig(
        image_size=64, hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3],
        depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=LABELS))),
    "perceiver": lambda: ("image", _t.PerceiverForImageClassificationLearned(_t.PerceiverConfig(
        num_latents=8, d_latents=32, d_model=32, num_blocks=1, num_self_attends_per_block=1,
        num_self_attention_heads=4, num_cross_attention_heads=4, image_size=16,
        num_labels=LABELS))),
    "imagegpt": lambda: ("pixel-ids", _t.ImageGPTForImageClassification(_t.ImageGPTConfig(
        vocab_size=17, n_positions=64, n_embd=32, n_layer=2, n_head=4, num_labels=LABELS))),
}
NAMES = (*CAUSAL, *ENCODERS, *VISION, *SEQ2SEQ, *AUDIO, *VIDEO, *OTHERS)


class Classifier(nn.Module):
    """The logits of a Hugging Face model; `causal` ones take token ids like `ids`."""

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, x, y=None):
        if self.kind == "causal":
            return self.model(input_ids=x, use_cache=False).logits
        if self.kind == "encoder":
            return self.model(input_ids=x).logits
        if self.kind == "seq2seq":
            return self.model(input_ids=x, decoder_input_ids=y, use_cache=False).logits
        if self.kind == "features":  # log-mel features in, the decoder's ids' logits out
            return self.model(input_features=x, decoder_input_ids=y, use_cache=False).logits
        if self.kind == "audio":
            return self.model(input_values=x).logits
        if self.kind == "pixel-ids":
            return self.model(input_ids=x).logits
        if self.kind == "clip":  # image-text similarities, two towers
            return self.model(input_ids=x, pixel_values=y).logits_per_image
        return self.model(pixel_values=x).logits  # images and videos


def build_model(config=None):
    auto = transformers.AutoConfig.for_model
    if config in CAUSAL:
        model_type, fields = CAUSAL[config]
        return Classifier(transformers.AutoModelForCausalLM.from_config(auto(model_type, **fields)),
                          "causal")
    if config in ENCODERS:
        cfg = auto(config, num_labels=LABELS, **ENCODERS[config])
        return Classifier(transformers.AutoModelForSequenceClassification.from_config(cfg),
                          "encoder")
    if config in VISION:
        cfg = auto(config, num_labels=LABELS, **VISION[config])
        return Classifier(transformers.AutoModelForImageClassification.from_config(cfg), "image")
    if config in SEQ2SEQ:
        cfg = auto(config, **SEQ2SEQ[config])
        return Classifier(transformers.AutoModelForSeq2SeqLM.from_config(cfg), "seq2seq")
    if config in AUDIO:
        cfg = auto(config, num_labels=LABELS, **AUDIO[config])
        return Classifier(transformers.AutoModelForAudioClassification.from_config(cfg), "audio")
    if config in VIDEO:
        cfg = auto(config, num_labels=LABELS, **VIDEO[config])
        return Classifier(transformers.AutoModelForVideoClassification.from_config(cfg), "image")
    if config in OTHERS:
        kind, model = OTHERS[config]()
        return Classifier(model, kind)
    raise ValueError(f"unknown config {config!r}; expected one of {', '.join(NAMES)}")


def example_inputs(model, batch_size):
    ids = torch.randint(3, VOCAB, (batch_size, SEQ))  # above the pad and start ids
    if model.kind == "image":
        config = model.model.config
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        frames = (config.num_frames,) if config.model_type in VIDEO else ()
        return (torch.randn(batch_size, *frames, 3, size, size),)
    if model.kind == "features":
        config = model.model.config
        features = (8, 32) if config.model_type == "whisper" else (40, 8)  # (mels, frames)
        return (torch.randn(batch_size, *features), torch.randint(3, VOCAB, (batch_size, SEQ // 2)))
    if model.kind == "pixel-ids":  # an 8 x 8 image's colour-cluster ids
        return (torch.randint(0, 16, (batch_size, 64)),)
    if model.kind == "seq2seq":
        return (ids, torch.randint(3, VOCAB, (batch_size, SEQ // 2)))
    if model.kind == "audio":
        return (torch.randn(batch_size, 800),)
    if model.kind == "clip":
        return (ids, torch.randn(batch_size, 3, 16, 16))
    return (ids,)


def loss_fn(logits, batch):
    if logits.dim() == 3:  # next-token loss (of the decoder's ids for encoder-decoders)
        ids = batch[-1]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    labels = torch.arange(logits.shape[0], device=logits.device) % logits.shape[1]
    return F.cross_entropy(logits, labels)
