"""A recommender in the style of DLRM: a bottom MLP over dense features, bags of embeddings
(nn.EmbeddingBag, one lookup of several ids per table), pairwise dot-product interactions
picked with triu_indices, a top MLP; two inputs, one of them integer."""

import torch
import torch.nn.functional as F
from torch import nn

TABLES, ROWS, BAG = 3, 50, 4


class DLRM(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, d), nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(ROWS, d, mode="sum") for _ in range(TABLES))
        n = TABLES + 1
        self.top = nn.Sequential(nn.Linear(d + n * (n - 1) // 2, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense, sparse):
        x = self.bottom(dense)
        feats = [x] + [t(sparse[:, i]) for i, t in enumerate(self.tables)]
        z = torch.stack(feats, dim=1)
        inter = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
        return self.top(torch.cat([x, inter[:, i, j]], dim=1)).squeeze(1)


def build_model(config=None):
    return DLRM()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 8), torch.randint(0, ROWS, (batch_size, TABLES, BAG)))


def loss_fn(out, batch):
    dense, _ = batch
    return F.binary_cross_entropy_with_logits(out, (dense[:, 0] > 0).to(out.dtype))
