"""torchvision's classification, semantic segmentation and detection models, built by their
registered names (`--config resnet50`) without weights (nothing is downloaded) and with 5
classes.

- classification: at the smallest of SIZES at which the model builds and runs on the meta
  device, up to its default size (ViTs take it as `image_size`, MaxViT as `input_size`); the
  loss adds the cross-entropy of the logits and of any auxiliary logits (GoogLeNet,
  Inception v3 in training);
- segmentation: at the same reduced size, a per-pixel cross-entropy of the `out` map;
- detection: images of 64 pixels (the models' own transform resizes them) and one made-up
  box per image; the forward returns the model's losses in training, and the loss is their
  sum. Their box matching, sampling and non-maximum suppression have shapes that depend on
  values, which atomc refuses (docs/model-files.md, Limits).

torchvision needs the CUDA torch it was built for (tests/shims/README.md): bench/survey.py's
torchvision suite runs it in a virtual environment of its own (`make survey
SUITE=torchvision`).
"""

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision import models

from atomc.trace import parameters_on_meta

CLASSES = 5
SIZES = (32, 64, 96, 128, 160, 192, 224, 256, 299)
DETECTION_SIZE = 64
# the kinds of models, by the torchvision module that registers them
KINDS = {"classification": models, "segmentation": models.segmentation,
         "detection": models.detection}
NAMES = tuple(n for m in KINDS.values() for n in models.list_models(module=m))
# what torchvision raises for an image size a model does not take: an unknown size keyword
# (TypeError), a size its position embeddings, windows or strides do not fit
_SIZE_ERRORS = (TypeError, ValueError, AssertionError, RuntimeError, IndexError)


class Detector(nn.Module):
    """A torchvision detection model in training: images and one box and label per image in,
    its dictionary of losses out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images, boxes, labels):
        targets = [{"boxes": b, "labels": c} for b, c in zip(boxes, labels)]
        return self.model(list(images), targets)


def kind_of(name):
    return next(k for k, m in KINDS.items() if name in models.list_models(module=m))


def build_model(config=None):
    if config not in NAMES:
        raise ValueError(f"unknown config {config!r}; expected a torchvision model name: "
                         f"{', '.join(NAMES)}")
    kind = kind_of(config)
    if kind == "detection":
        model = Detector(_create(config, {}))
        model.input_size = DETECTION_SIZE
        return model
    kwargs, size = _reduced(config)
    model = _create(config, kwargs)
    model.input_size = size  # read by example_inputs
    return model


def example_inputs(model, batch_size):
    size = model.input_size
    images = torch.randn(batch_size, 3, size, size)
    if isinstance(model, Detector):
        corner = torch.rand(batch_size, 1, 2) * size / 2
        boxes = torch.cat([corner, corner + size / 4], dim=-1)
        labels = torch.randint(1, CLASSES, (batch_size, 1))
        return (images, boxes, labels)
    return (images,)


def loss_fn(outputs, batch):
    if isinstance(outputs, dict) and "out" not in outputs:  # a detector's losses
        return sum(outputs.values())
    images = batch[0]
    if isinstance(outputs, dict):  # segmentation: a class per pixel, decided by the image
        labels = (images.mean(dim=1) * 1e3).long().remainder(CLASSES)
        return F.cross_entropy(outputs["out"], labels)
    labels = (images.mean(dim=(1, 2, 3)) * 1e3).long().remainder(CLASSES)
    logits = outputs if isinstance(outputs, torch.Tensor) else [o for o in outputs
                                                                if o is not None]
    if isinstance(logits, torch.Tensor):
        return F.cross_entropy(logits, labels)
    return sum(F.cross_entropy(o, labels) for o in logits)


def _create(name, kwargs):
    extra = {} if kind_of(name) == "classification" else {"weights_backbone": None}
    return models.get_model(name, weights=None, num_classes=CLASSES, **extra, **kwargs)


def _reduced(name):
    """(size keywords, image size): the smallest of SIZES at which `name` builds and runs."""
    for size in SIZES:
        for kwargs in ({"image_size": size}, {"input_size": (size, size)}, {}):
            if _runs_at(name, kwargs, size):
                return kwargs, size
    raise ValueError(f"torchvision {torchvision.__version__}'s {name} runs at none of the "
                     f"image sizes {SIZES}")


def _runs_at(name, kwargs, size):
    """Whether `name`, made with `kwargs`, runs a batch of two `size` images in training (on
    the meta device: shapes only, nothing computed)."""
    try:
        model = on_meta(name, kwargs)
        model(torch.empty(2, 3, size, size, device="meta"))
    except _SIZE_ERRORS:
        return False
    return True


def on_meta(name, kwargs=None):
    """Model `name` on the meta device; one whose constructor reads tensor values (RegNet's
    widths) is built on the CPU with its parameters on meta, as atomc builds it."""
    try:
        with torch.device("meta"):
            return _create(name, kwargs or {})
    except NotImplementedError:
        with parameters_on_meta():
            return _create(name, kwargs or {}).to("meta")
