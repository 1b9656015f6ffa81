"""An atomc model file that wraps the model.py beside it, as one wraps an existing repository.

Training: the whole sequence's logits (targets given). Inference (`--config last`): the last
position's logits, as nanoGPT's generate() asks for them.
"""

import torch
import torch.nn.functional as F
from model import GPT, GPTConfig
from torch import nn


class Trainable(nn.Module):
    """nanoGPT's GPT with its targets as a second input, returning logits and loss."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, targets):
        return self.gpt(idx, targets)


def build_model(config=None):
    gpt = GPT(GPTConfig(dropout=0.1 if config == "dropout" else 0.0))
    return gpt if config == "last" else Trainable(gpt)


def example_inputs(model, batch_size):
    idx = torch.randint(0, 96, (batch_size, 16))
    if isinstance(model, GPT):
        return (idx,)
    return (idx, torch.roll(idx, -1, dims=1))


def loss_fn(outputs, batch):
    logits, loss = outputs
    if loss is not None:
        return loss
    (idx,) = batch
    return F.cross_entropy(logits[:, -1], idx[:, 0])
