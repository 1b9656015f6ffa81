"""Models of timm's zoo, made by `timm.create_model` from their registered names in tiny
configurations (`--config NAME`); nothing is downloaded.

- `efficientnet`: timm's own test EfficientNet: BatchNorm, squeeze-excitation, depthwise and
  edge-residual blocks, SiLU, stochastic depth;
- `convnext`: timm's test ConvNeXt: channels-last LayerNorm, 7x7 depthwise convolutions,
  layer scale (made 0.5 from timm's 1e-6, so that every block counts in the checks);
- `swin`: a Swin transformer: shifted-window attention with its masks and relative position
  biases, patch merging;
- `vit`: timm's test ViT: class token, learned positions, fused qkv, stochastic depth (the
  positions for one image size, as timm's ViTs have them by default: with `dynamic_img_size`,
  timm resamples them through float32 when torch.export traces the model, and not when it
  runs, so the float64 check sees float32 rounding in their gradient).

Any other registered name is made with its default configuration, num_classes=5 and the image
size of its pretrained configuration.

timm imports torchvision; the tests import timm through the stand-in in tests/shims where no
torchvision is installed (tests/shims/README.md)."""

import timm
import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 5
# name -> (timm name, keyword arguments for create_model, image size)
CONFIGS = {
    "efficientnet": ("test_efficientnet", {"drop_path_rate": 0.1}, 64),
    "convnext": ("test_convnext", {"depths": (1, 1, 2, 1), "ls_init_value": 0.5,
                                   "drop_path_rate": 0.1}, 32),
    "swin": ("swin_tiny_patch4_window7_224",
             {"img_size": 32, "window_size": 4, "embed_dim": 16, "depths": (2, 1),
              "num_heads": (2, 4), "drop_path_rate": 0.1}, 32),
    "vit": ("test_vit", {"img_size": 32, "patch_size": 8, "depth": 3, "dynamic_img_size": False,
                         "drop_path_rate": 0.1}, 32),
}


def build_model(config=None) -> nn.Module:
    name, kwargs, size = _config(config)
    model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)
    # timm's own record of the input a model takes, here the tiny configuration's
    model.pretrained_cfg = {**model.pretrained_cfg, "input_size": (3, size, size)}
    return model


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, *model.pretrained_cfg["input_size"]),)


def loss_fn(logits, batch):
    (x,) = batch
    labels = (x.mean(dim=(1, 2, 3)) * 1e3).long().remainder(CLASSES)  # the image decides
    return F.cross_entropy(logits, labels)


def _config(config):
    if config in CONFIGS:
        return CONFIGS[config]
    if config is not None and timm.is_model(config):
        size = timm.get_pretrained_cfg_value(config, "input_size") or (3, 224, 224)
        return config, {}, size[-1]
    raise ValueError(f"unknown configuration {config!r}: give one of {', '.join(CONFIGS)} or "
                     f"a timm model name (timm.list_models())")
