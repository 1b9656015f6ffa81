"""A VAE: the latent drawn with torch.distributions (`Normal(mu, sigma).rsample()`, whose
argument checks read tensor values), a KL term returned beside the reconstruction, and a
decoder ending in a sigmoid."""
import torch
import torch.nn.functional as F
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.mu = nn.Linear(32, 4)
        self.logvar = nn.Linear(32, 4)
        self.dec = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                 nn.Linear(32, 16))

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = torch.distributions.Normal(mu, torch.exp(0.5 * logvar)).rsample()
        kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        return torch.sigmoid(self.dec(z)), kl


def build_model(config=None):
    return Model()


def example_inputs(model, batch_size):
    return (torch.rand(batch_size, 16),)


def loss_fn(out, batch):
    recon, kl = out
    return F.mse_loss(recon, batch[0].sigmoid()) + kl
