"""A tiny BERT encoder from transformers, returning its own ModelOutput (last_hidden_state,
pooler_output). Its embeddings hold non-persistent buffers (position_ids, token_type_ids) that
no state dict carries."""

import torch
from transformers import BertConfig, BertModel


def build_model(config=None):
    cfg = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32)
    return BertModel(cfg)


def example_inputs(model, batch_size):
    return (torch.randint(0, 96, (batch_size, 12)),)


def loss_fn(outputs, batch):
    return outputs.last_hidden_state.pow(2).mean() + outputs.pooler_output.mean()
