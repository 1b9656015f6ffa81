"""A tiny T5 from transformers: an encoder-decoder with two inputs (the source ids and the
decoder's), whose one embedding is read three times (the encoder's and the decoder's
embeddings, and the tied output layer), so three sub-models hold it."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

VOCAB, SOURCE, TARGET = 96, 12, 6


class Seq2Seq(nn.Module):
    """The logits for the decoder's ids, given the source ids (positional inputs)."""

    def __init__(self):
        super().__init__()
        cfg = T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8,
                       tie_word_embeddings=True)
        self.t5 = T5ForConditionalGeneration(cfg)

    def forward(self, source, target):
        return self.t5(input_ids=source, decoder_input_ids=target, use_cache=False).logits


def build_model(config=None):
    return Seq2Seq()


def example_inputs(model, batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SOURCE)),
            torch.randint(0, VOCAB, (batch_size, TARGET)))


def loss_fn(logits, batch):
    _, target = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), target[:, 1:].reshape(-1))
