"""A tiny language model whose output layer reads the embedding's weight directly
(`F.linear(x, self.emb.weight)`), plus a free parameter and a persistent buffer."""

import torch
import torch.nn.functional as F
from torch import nn


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 20, width: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        self.norm = nn.LayerNorm(width)
        self.gain = nn.Parameter(torch.ones(width))
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, width))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.body(x)
        x = self.norm(x) * self.gain + self.shift
        return F.linear(x, self.emb.weight)  # tied: the embedding's weight again


def build_model(config: str | None = None) -> nn.Module:
    return TiedLM()


def example_inputs(model: nn.Module, batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 20, (batch_size, 5)),)


def loss_fn(logits: torch.Tensor, batch: tuple) -> torch.Tensor:
    (idx,) = batch
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx.reshape(-1))
