"""A character-level language model of recurrent layers, as people write them: an embedding,
a two-layer LSTM, a GRU over its output, a projection tied to the embedding."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 40, 16


class CharRNN(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True, dropout=0.1)
        self.gru = nn.GRU(width, width, batch_first=True, bidirectional=True)
        self.proj = nn.Linear(2 * width, width)
        self.out = nn.Linear(width, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        h, _ = self.lstm(self.embed(ids))
        h, last = self.gru(h)
        h = torch.tanh(self.proj(h)) + last.mean(0).unsqueeze(1)
        return self.out(h)


def build_model(config=None):
    return CharRNN()


def example_inputs(model, batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def loss_fn(logits, batch):
    (ids,) = batch
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
