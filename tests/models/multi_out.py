"""Two inputs (one read only at the end), an in-place update whose result nothing reads, and a
nested output: an OrderedDict (as torchvision's segmentation models return; symbolic tracing
makes every dict a plain one, and the package must give the class back) with a tuple inside,
one entry computed in the first sub-model."""

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn


class MultiOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(6, 12)
        self.mid = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> dict:
        features = self.enc(x)  # an output computed in the first sub-model
        h = self.mid(features).clone()
        h.mul_(0.5)  # in place, its result unused: must not be dropped as dead code
        g = F.gelu(h)
        logits = self.head(g) * scale  # `scale` is read only here
        return OrderedDict(logits=logits, features=features,
                           stats=(g.mean(dim=-1), logits.amax(dim=-1)))


def build_model(config: str | None = None) -> nn.Module:
    return MultiOut()


def example_inputs(model: nn.Module, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 6), torch.rand(batch_size, 1) + 0.5


def loss_fn(outputs: dict, batch: tuple) -> torch.Tensor:
    mean, peak = outputs["stats"]
    return (outputs["logits"].pow(2).mean() + outputs["features"].abs().mean()
            + mean.sum() * 0.1 + peak.sum() * 0.01)
