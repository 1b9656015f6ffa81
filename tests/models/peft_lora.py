"""A tiny Hugging Face Llama with a peft LoRA adapter on its attention projections: the base
weights frozen (they come from a Hugging Face checkpoint, `atomc train --weights`), the
adapter's trained. Built from a config, nothing downloaded.
"""

import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn

VOCAB, SEQ = 128, 16
BASE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 64}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


class LoraLM(nn.Module):
    """The peft model's logits for token ids (no cache, no loss)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def base_config() -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model("llama", **BASE)


def build_model(config=None) -> nn.Module:
    base = transformers.AutoModelForCausalLM.from_config(base_config(), dtype=torch.float32)
    return LoraLM(get_peft_model(base, LoraConfig(**LORA)))


def example_inputs(model: nn.Module, batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def loss_fn(logits: torch.Tensor, batch: tuple[torch.Tensor]) -> torch.Tensor:
    (ids,) = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
