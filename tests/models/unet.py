"""A small U-Net, as segmentation code writes it: convolution blocks with BatchNorm and
GroupNorm, max pooling down, transposed convolutions and bilinear upsampling up, and skip
connections that carry early activations to the last layers (across every cut)."""

import torch
import torch.nn.functional as F
from torch import nn


def block(cin: int, cout: int, norm: str) -> nn.Sequential:
    layer = nn.BatchNorm2d(cout) if norm == "batch" else nn.GroupNorm(4, cout)
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), layer,
                         nn.ReLU(inplace=True), nn.Conv2d(cout, cout, 3, padding=1))


class UNet(nn.Module):
    def __init__(self, classes: int = 3, width: int = 8):
        super().__init__()
        self.down1 = block(3, width, "batch")
        self.down2 = block(width, 2 * width, "group")
        self.bottom = block(2 * width, 4 * width, "batch")
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = block(4 * width, 2 * width, "group")
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec1 = block(2 * width + width, width, "batch")
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        b = self.bottom(F.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(b), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.head(u1)


def build_model(config=None):
    return UNet()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 3, 16, 16),)


def loss_fn(logits, batch):
    (x,) = batch
    target = (x.mean(1) > 0).long() + (x.std(1) > 1).long()  # a made-up mask per pixel
    return F.cross_entropy(logits, target)
