"""Tiny random configurations of many Hugging Face families, one model file for all of them:
`--config NAME` picks one (tests/test_families.py runs the whole chain on each).

Causal LMs return their logits (next-token loss); encoders their classification logits and
image models theirs (a made-up label per sample). Nothing is downloaded.
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
NAMES = (*CAUSAL, *ENCODERS, *VISION)


class Classifier(nn.Module):
    """The logits of a Hugging Face model; `causal` ones take token ids like `ids`."""

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, x):
        if self.kind == "causal":
            return self.model(input_ids=x, use_cache=False).logits
        if self.kind == "encoder":
            return self.model(input_ids=x).logits
        return self.model(pixel_values=x).logits


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
    raise ValueError(f"unknown config {config!r}; expected one of {', '.join(NAMES)}")


def example_inputs(model, batch_size):
    if model.kind == "image":
        size = getattr(model.model.config, "image_size", 32)
        return (torch.randn(batch_size, 3, size, size),)
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def loss_fn(logits, batch):
    if logits.dim() == 3:  # next-token loss
        (ids,) = batch
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    labels = torch.arange(logits.shape[0], device=logits.device) % logits.shape[1]
    return F.cross_entropy(logits, labels)
