"""The one transform timm's modules name when imported (a base class); it cannot be made."""

from .._missing import module_getattr, unavailable_class
from . import functional

__all__ = ["ToTensor", "functional"]
__getattr__ = module_getattr(__name__)

ToTensor = unavailable_class(__name__, "ToTensor")
