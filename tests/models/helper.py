"""A model that calls a helper function (kept whole by torch.fx.wrap) and a leaf module class
of its own with a dataclass configuration: atomc copies all of them into the package."""

import math
from dataclasses import dataclass

import torch
from torch import nn

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (as in GPT-2)."""
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * cube(x))))


torch.fx.wrap("new_gelu")


@dataclass(frozen=True)
class MixerConfig:
    width: int
    scale: float = 0.5


class Mixer(nn.Module):
    """Traced as one operator (LEAF_MODULES)."""

    def __init__(self, cfg: MixerConfig):
        super().__init__()
        self.cfg = cfg
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cfg.scale * new_gelu(self.proj(x))


LEAF_MODULES = (Mixer,)


class HelperNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mix = Mixer(MixerConfig(16, scale=0.25))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = new_gelu(self.inp(x))
        h = self.mix(h)
        return self.out(new_gelu(h))


def build_model(config: str | None = None) -> nn.Module:
    return HelperNet()


def example_inputs(model: nn.Module, batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 8),)


def loss_fn(outputs: torch.Tensor, batch: tuple) -> torch.Tensor:
    return outputs.pow(2).mean()
