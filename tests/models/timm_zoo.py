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

Any other registered name (bench/survey.py's timm suite) is made with its default
configuration and num_classes=5, at the smallest of SIZES, up to the image size of its
pretrained configuration, at which it builds and runs on the meta device: models with learned
position embeddings take the size as `img_size`, convolutional ones any size their strides
leave at least one pixel of.

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


# the reduced image sizes tried, smallest first
SIZES = (64, 96, 128, 160, 192, 224, 256)
# what timm raises for an image size an architecture does not take: an unknown `img_size`
# keyword (TypeError), a size its position embeddings, windows or strides do not fit
_SIZE_ERRORS = (TypeError, ValueError, AssertionError, RuntimeError, IndexError)


def _config(config):
    if config in CONFIGS:
        return CONFIGS[config]
    if config is not None and timm.is_model(config):
        with torch.device("meta"):  # deprecated names too (adv_inception_v3)
            cfg = timm.create_model(config, pretrained=False, num_classes=CLASSES).pretrained_cfg
        full = cfg.get("input_size", (3, 224, 224))[-1]
        for size in (s for s in SIZES if s < full):
            for kwargs in ({"img_size": size}, {}):
                if _runs_at(config, kwargs, size):
                    return config, kwargs, size
        return config, {}, full
    raise ValueError(f"unknown configuration {config!r}: give one of {', '.join(CONFIGS)} or "
                     f"a timm model name (timm.list_models())")


def _runs_at(name, kwargs, size):
    """Whether timm model `name`, made with `kwargs`, runs a batch of `size` images (on the
    meta device: shapes only, nothing computed)."""
    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)
            model(torch.empty(1, 3, size, size))
    except _SIZE_ERRORS:
        return False
    return True
