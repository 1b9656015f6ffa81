"""A Perceiver-style model written by hand: learned latent queries, expanded over the batch,
attend to the inputs; the expanded latents (a view of a weight, no copy) are read again by the
last layer, so they cross cuts between sub-models, as Hugging Face's Perceiver's do."""

import torch
import torch.nn.functional as F
from torch import nn

TOKENS, FEATURES, LATENTS, WIDTH, CLASSES = 12, 16, 6, 32, 4


class LatentClassifier(nn.Module):
    def __init__(self, depth: int = 4):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(LATENTS, WIDTH) * 0.5)
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.cross = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                          nn.Linear(2 * WIDTH, WIDTH)) for _ in range(depth))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        queries = self.latents.expand(x.shape[0], -1, -1)
        keys = self.embed(x)
        h, _ = self.cross(queries, keys, keys, need_weights=False)
        for block in self.blocks:
            h = h + block(h)
        return self.head((h + queries).mean(dim=1))  # the queries again, after every block


def build_model(config=None):
    return LatentClassifier()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, TOKENS, FEATURES),)


def loss_fn(logits, batch):
    labels = torch.arange(logits.shape[0], device=logits.device) % CLASSES
    return F.cross_entropy(logits, labels)
