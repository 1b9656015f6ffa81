"""InterpolationMode, as torchvision defines it (timm maps its members to PIL's filters when
imported); no image function is provided."""

from enum import Enum

from .._missing import module_getattr

__getattr__ = module_getattr(__name__)


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
