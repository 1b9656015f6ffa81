"""A test-only stand-in for torchvision: tests/shims/README.md says why and what it provides.

Only `shims.import_timm()` puts it where `import torchvision` finds it, and only while timm
is imported."""

from . import datasets, ops, transforms
from ._missing import module_getattr

__all__ = ["datasets", "ops", "transforms"]
__getattr__ = module_getattr(__name__)
