"""Python control flow on a shape: torch.fx symbolic tracing rejects it, torch.export
specialises it to the traced batch size."""

import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(5, 10)
        self.norm = nn.LayerNorm(10)
        self.l2 = nn.Linear(10, 10)
        self.l3 = nn.Linear(10, 2)
        self.register_buffer("shift", torch.arange(10.0) / 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if h.shape[0] > 1:  # data-dependent Python: a Proxy cannot be a condition
            h = h - h.mean(dim=0, keepdim=True)
        h = torch.relu(self.l2(self.norm(h) + self.shift))
        return self.l3(h)


def build_model(config: str | None = None) -> nn.Module:
    return Branchy()


def example_inputs(model: nn.Module, batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 5),)


def loss_fn(outputs: torch.Tensor, batch: tuple) -> torch.Tensor:
    return outputs.pow(2).mean()
