"""A convolutional stem written as vision backbones write theirs: a convolution, BatchNorm, a
do-nothing module standing in for an optional one (`nn.Identity()` where a drop or attention
layer may go) and an activation that writes its input (`nn.SiLU(inplace=True)`). A cut before
the Identity hands the next sub-model a tensor that the activation writes through it."""

import torch
from torch import nn


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.attn = nn.Identity()
        self.act = nn.SiLU(inplace=True)
        self.flat = nn.Flatten()  # a view of its input, the other no-copy module kind
        self.drop = nn.Dropout(0.0)  # returns its input itself
        self.head = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        h = self.act(self.attn(self.bn(self.conv(x))))
        return self.head(torch.relu_(self.drop(self.flat(h))))


def build_model(config=None):
    return Stem()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 3, 6, 6),)


def loss_fn(outputs, batch):
    return outputs.pow(2).mean()
