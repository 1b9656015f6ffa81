"""A small MLP whose first hidden state skips over later layers (a residual across cuts), and
whose layer `a` is applied twice (one module, so one set of weights, in two sub-models)."""

import torch
from torch import nn


class SkipNet(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        a = torch.relu(self.a(h))
        a = torch.relu(self.a(a))  # the same layer again
        b = torch.relu(self.b(a))
        c = self.c(b)
        return self.out(c + h)  # h is read three layers later


def build_model(config: str | None = None) -> nn.Module:
    return SkipNet()


def example_inputs(model: nn.Module, batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 8),)


def loss_fn(outputs: torch.Tensor, batch: tuple) -> torch.Tensor:
    return outputs.pow(2).mean()
