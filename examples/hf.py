"""Hugging Face causal language models as an atomc model file.

    atomc profile examples/hf.py --config llama-2-70b --target a100-80gb
    atomc profile examples/hf.py --config path/to/config.json --device cuda --seq-len 1024

`--config` is a preset name below or the path of a `config.json` (the file a Hugging Face model
repository ships). Models are built from their configuration alone with random weights: nothing
is downloaded. atomc builds them on the meta device for tracing and estimating, so a 70B model
costs no memory until it is trained; load real weights into the generated sub-models with
`load_original_state_dict(submodels, model.state_dict())`.

The model's forward takes the token ids and returns the logits; `loss_fn` is the next-token
cross-entropy on them. Needs transformers (`pip install 'atomc[hf]'`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# name -> (model_type, configuration fields, default sequence length). Sizes are the published
# ones; fields not given keep transformers' defaults for the model type. The tiny ones are for
# tests: two layers, random weights, every family's distinctive parts kept (grouped-query
# attention, rotary embeddings, sliding windows, partial rotary, parallel residuals).
PRESETS: dict[str, tuple[str, dict, int]] = {
    "gpt2": ("gpt2", {
        "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024,
    }, 1024),
    "gpt2-xl": ("gpt2", {
        "n_embd": 1600, "n_layer": 48, "n_head": 25, "vocab_size": 50257, "n_positions": 1024,
    }, 1024),
    "llama-2-7b": ("llama", {
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
    }, 4096),
    "llama-2-13b": ("llama", {
        "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
    }, 4096),
    "llama-2-70b": ("llama", {
        "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
    }, 4096),
    "llama-3-8b": ("llama", {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
    }, 8192),
    # Llama-shaped models of the GPT-3 sizes for the side-by-side benchmark (bench/side_by_side.py):
    # 1.3B and 2.7B are Sheared-LLaMA's shapes (Xia et al., arXiv 2310.06694), 6.7B is LLaMA-7B's
    "llama-1.3b": ("llama", {
        "hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
    }, 2048),
    "llama-2.7b": ("llama", {
        "hidden_size": 2560, "intermediate_size": 6912, "num_hidden_layers": 32,
        "num_attention_heads": 20, "num_key_value_heads": 20, "vocab_size": 32000,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
    }, 2048),
    "llama-6.7b": ("llama", {
        "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-06,
    }, 2048),
    "mistral-7b": ("mistral", {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 32768, "sliding_window": 4096, "rms_norm_eps": 1e-05,
    }, 4096),
    "qwen2-7b": ("qwen2", {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    }, 4096),
    "tiny-gpt2": ("gpt2", {
        "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0,  # GPT-2's 50256 is outside a 128-token vocabulary
    }, 16),
    "tiny-llama": ("llama", {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 64,
    }, 16),
    "tiny-mistral": ("mistral", {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 64, "sliding_window": 8,
    }, 16),
    "tiny-qwen2": ("qwen2", {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 64,
    }, 16),
    "tiny-opt": ("opt", {
        "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 128, "max_position_embeddings": 64, "word_embed_proj_dim": 32,
    }, 16),
    "tiny-gpt-neox": ("gpt_neox", {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 128, "max_position_embeddings": 64,
        "rotary_pct": 0.5,
    }, 16),
    "tiny-falcon": ("falcon", {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128,
        "new_decoder_architecture": True, "num_kv_heads": 2,  # its MLP adds a residual in place
    }, 16),
    "tiny-phi": ("phi", {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 128, "max_position_embeddings": 64,
        "partial_rotary_factor": 0.5,
    }, 16),
}

INSTALL = "pip install 'atomc[hf]' (or: pip install transformers)"


class CausalLM(nn.Module):
    """A Hugging Face causal LM whose forward maps token ids to logits (no cache, no loss)."""

    def __init__(self, model: nn.Module, seq_len: int):
        super().__init__()
        self.model = model
        self.seq_len = seq_len
        self.vocab_size = int(model.config.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(f"examples/hf.py needs transformers: {INSTALL}") from None
    return transformers


def load_config(config: str | None):
    """(transformers config, default sequence length) for a preset name or a config.json path."""
    transformers = _transformers()
    name = config or "tiny-llama"
    if name in PRESETS:
        model_type, fields, seq_len = PRESETS[name]
        return transformers.AutoConfig.for_model(model_type, **fields), seq_len
    path = Path(name)
    if not path.suffix == ".json" and not path.exists():
        raise ValueError(f"unknown config {name!r}: give a preset ({', '.join(PRESETS)}) "
                         f"or the path of a Hugging Face config.json")
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror}; give the path of a "
                         f"Hugging Face config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); expected a Hugging Face "
                         f"config.json") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise ValueError(f"{path} has no \"model_type\"; expected a Hugging Face config.json, "
                         f"which names its architecture there (e.g. \"llama\")")
    model_type = fields.pop("model_type")
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **fields)
    except ValueError:
        raise ValueError(f"{path}: model_type {model_type!r} is not an architecture transformers "
                         f"{transformers.__version__} knows; expected one of its model types "
                         f"(e.g. llama, gpt2, mistral), or upgrade transformers") from None
    context = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048)
    return cfg, min(int(context), 4096)


def build_model(config: str | None = None, seq_len: int | None = None) -> nn.Module:
    transformers = _transformers()
    cfg, default_seq = load_config(config)
    try:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except ValueError as e:
        raise ValueError(f"transformers has no causal language model for config {config!r} "
                         f"(model_type {cfg.model_type!r}): {str(e).splitlines()[0]}") from None
    return CausalLM(model, seq_len or default_seq)


def example_inputs(model: CausalLM, batch_size: int,
                   seq_len: int | None = None) -> tuple[torch.Tensor]:
    return (torch.randint(0, model.vocab_size, (batch_size, seq_len or model.seq_len)),)


def loss_fn(logits: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
    """Next-token loss: the targets are the input tokens shifted by one."""
    (ids,) = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
