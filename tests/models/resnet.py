"""A small ResNet-style CNN: convolutions, BatchNorm2d with running statistics, residual
additions and global pooling, trained on random images with a classification loss."""

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths=(8, 16, 32), num_classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(cin, w, 1 if i == 0 else 2))
            cin = w
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        h = F.relu(self.bn(self.stem(x)))
        h = self.layers(h)
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        return self.fc(h)


def build_model(config=None):
    return ResNet()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, 3, 16, 16),)


def loss_fn(outputs, batch):
    (x,) = batch
    labels = (x.mean(dim=(1, 2, 3)) > 0).long()  # a label the images themselves decide
    return F.cross_entropy(outputs, labels)
