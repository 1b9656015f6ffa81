"""An encoder from torch.nn's own composite layers (TransformerEncoder, MultiheadAttention):
torch.fx would keep them whole, and codegen could neither cut inside them nor rebuild them
from their attributes; atomc traces through them."""

import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 64)
    def forward(self, ids):
        h = self.enc(self.emb(ids))
        h, _ = self.mha(h, h, h, need_weights=False)
        return self.head(h)

def build_model(config=None):
    return Encoder()

def example_inputs(model, batch_size):
    return (torch.randint(0, 64, (batch_size, 10)),)

def loss_fn(outputs, batch):
    (ids,) = batch
    return torch.nn.functional.cross_entropy(outputs.flatten(0, 1), ids.flatten())
