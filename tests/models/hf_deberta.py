"""A tiny DeBERTa-v2 classifier from transformers. Its attention masks scores with
`torch.finfo(scores.dtype).min`, which a float32 trace records as -3.4e38: bfloat16 overflows
on it unless generated code asks the dtype again at run time."""

import torch
import torch.nn.functional as F
from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

VOCAB, LABELS = 96, 5


def build_model(config=None):
    cfg = DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64,
                          max_position_embeddings=64, num_labels=LABELS)
    return DebertaV2ForSequenceClassification(cfg)


def example_inputs(model, batch_size):
    return (torch.randint(0, VOCAB, (batch_size, 12)),)


def loss_fn(outputs, batch):
    (ids,) = batch
    return F.cross_entropy(outputs.logits, ids[:, 0] % LABELS)
