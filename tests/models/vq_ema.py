"""A VQ-VAE-style model, as VQ-VAE-2 and SoundStream write theirs:

- a codebook (a buffer) looked up by argmin, with a straight-through estimator;
- the codebook and its usage updated in forward, in place, under no_grad (an EMA): the
  trace must keep every update (`mul_` then `add_`) and read the codebook as it is at each
  step, not as it was when the model was traced;
- channels-last convolutions, BatchNorm, MaxPool with indices and MaxUnpool.
"""
import torch
import torch.nn.functional as F
from torch import nn

CODES, DIM = 16, 8


class Quantizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("codebook", torch.randn(CODES, DIM))
        self.register_buffer("usage", torch.ones(CODES))

    def forward(self, z):  # z: (b, DIM, h, w)
        flat = z.permute(0, 2, 3, 1).reshape(-1, DIM)
        dist = (flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.codebook.t()
                + self.codebook.pow(2).sum(1))
        idx = dist.argmin(1)
        zq = F.embedding(idx, self.codebook).view(z.shape[0], z.shape[2], z.shape[3], DIM)
        zq = zq.permute(0, 3, 1, 2)
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(idx, CODES).type_as(flat)
                self.usage.mul_(0.99).add_(onehot.sum(0), alpha=0.01)
                self.codebook.mul_(0.99).add_(onehot.t() @ flat / (onehot.sum(0)[:, None] + 1),
                                              alpha=0.01)
        commit = F.mse_loss(z, zq.detach())
        return z + (zq - z).detach(), commit


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.enc2 = nn.Conv2d(16, DIM, 3, padding=1)
        self.quant = Quantizer()
        self.dec1 = nn.Conv2d(DIM, 16, 3, padding=1)
        self.unpool = nn.MaxUnpool2d(2)
        self.dec2 = nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.bn1(self.enc1(x)))
        h, where = self.pool(h)
        z = self.enc2(h)
        zq, commit = self.quant(z)
        h = F.relu(self.dec1(zq))
        h = self.unpool(h, where)
        return self.dec2(h), commit


def build_model(config=None):
    return Model().to(memory_format=torch.channels_last)


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 3, 8, 8).to(memory_format=torch.channels_last),)


def loss_fn(out, batch):
    recon, commit = out
    (x,) = batch
    return F.mse_loss(recon, x) + 0.25 * commit
