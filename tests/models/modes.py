"""A model with a torch.no_grad() region and a torch.autocast(enabled=False) region inside
forward, and a shape assert that symbolic tracing refuses: torch.export turns both regions
into higher-order operators."""

import torch
from torch import nn


class Modes(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16), persistent=False)

    def forward(self, x):
        assert x.shape[-1] == 8, "eight features"
        h = self.inp(x)
        with torch.no_grad():  # a statistic that must not take gradients
            centre = h.mean(dim=0, keepdim=True)
        with torch.autocast(device_type="cpu", enabled=False):  # full precision here
            h = (h.float() - centre.float()) * self.scale
        return self.out(torch.tanh(h).to(x.dtype))


def build_model(config=None):
    return Modes()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)


def loss_fn(outputs, batch):
    return outputs.pow(2).mean()
