"""Layers whose weight torch computes from other tensors, as audio and GAN models write them:
`parametrizations.weight_norm` (a gain and a direction), `parametrizations.spectral_norm`
(power-iteration vectors in buffers that every training forward updates), the older hook-based
`nn.utils.weight_norm` and `nn.utils.spectral_norm`, and parametrizations of the model's own
(on a torch layer, and on a module of the model's)."""

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


class Positive(nn.Module):
    def forward(self, g):
        return nn.functional.softplus(g)


class Gain(nn.Module):
    """A module of the model's own with a parametrized parameter: traced through."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(width))

    def forward(self, h):
        return h * self.gain


class Net(nn.Module):
    def __init__(self, width: int = 48):
        super().__init__()
        self.conv = parametrizations.weight_norm(nn.Conv1d(4, 8, 3, padding=1), dim=2)
        self.fc1 = parametrizations.spectral_norm(nn.Linear(8 * 16, width))
        self.fc2 = nn.utils.weight_norm(nn.Linear(width, width))
        self.fc2b = nn.utils.spectral_norm(nn.Linear(width, width))
        self.fc3 = parametrize.register_parametrization(nn.Linear(width, width), "weight",
                                                        Symmetric())
        self.fc4 = parametrizations.spectral_norm(nn.Linear(width, width), n_power_iterations=2)
        self.gain = parametrize.register_parametrization(Gain(width), "gain", Positive())
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        for layer in (self.fc1, self.fc2, self.fc2b, self.fc3, self.fc4):
            h = torch.tanh(layer(h))
        return self.head(self.gain(h))


def build_model(config=None):
    return Net()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 4, 16),)


def loss_fn(outputs, batch):
    (x,) = batch
    return (outputs - x[:, 0, :5]).pow(2).mean()
