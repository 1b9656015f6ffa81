"""Buffers a forward assigns, as older repos write BatchNorm themselves:

- running statistics updated in place under no_grad (`lerp_`), and reassigned outside it
  (`self.running_var = (1 - m) * self.running_var + ...`);
- a step counter buffer incremented with `+=`.

The trace must write each new value into its buffer and read the value itself for the rest
of the forward, as the eager model does.
"""
import torch
import torch.nn.functional as F
from torch import nn

DIM = 16


class RunningNorm(nn.Module):
    def __init__(self, dim, momentum=0.1):
        super().__init__()
        self.momentum = momentum
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_buffer("running_mean", torch.zeros(dim))
        self.register_buffer("running_var", torch.ones(dim))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            mean = x.mean(0)
            var = x.var(0, unbiased=False)
            with torch.no_grad():
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
            # reassigned, outside no_grad, as some repos write it
            self.running_var = ((1 - self.momentum) * self.running_var
                                + self.momentum * var.to(self.running_var.dtype))
            self.steps += 1
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, DIM)
        self.norm1 = RunningNorm(DIM)
        self.fc2 = nn.Linear(DIM, DIM)
        self.norm2 = RunningNorm(DIM)
        self.fc3 = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, 1)

    def forward(self, x):
        h = F.relu(self.norm1(self.fc1(x)))
        h = F.relu(self.norm2(self.fc2(h)))
        h = F.relu(self.fc3(h))
        return self.out(h)


def build_model(config=None):
    return Model()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8),)


def loss_fn(out, batch):
    (x,) = batch
    return F.mse_loss(out.squeeze(-1), x.sum(-1))
