"""Custom autograd Functions whose backward is not the derivative of their forward: a domain
classifier behind a gradient reversal layer (DANN) and a straight-through rounding
quantiser. Traced, each must stay one call to `TheFunction.apply`: tracing through it would
train with autograd's derivative of the forward (reversal's +1, rounding's 0) instead."""

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, HIDDEN, CLASSES, DOMAINS = 24, 48, 5, 2


class GradientReversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class RoundStraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step):
        return torch.round(x / step) * step

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class DomainAdversarial(nn.Module):
    """Class logits and domain logits from one quantised feature extractor."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(),
                                      nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.classes = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                     nn.Linear(HIDDEN, CLASSES))
        self.domains = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                     nn.Linear(HIDDEN, DOMAINS))

    def forward(self, x):
        h = RoundStraightThrough.apply(self.features(x), 1 / 16)
        return self.classes(h), self.domains(GradientReversal.apply(h, 0.5))


def build_model(config=None):
    return DomainAdversarial()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, FEATURES),)


def loss_fn(outputs, batch):
    classes, domains = outputs
    n = classes.shape[0]
    labels = torch.arange(n, device=classes.device)
    return F.cross_entropy(classes, labels % CLASSES) + F.cross_entropy(domains, labels % DOMAINS)
