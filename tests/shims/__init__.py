"""Stand-ins the tests import third-party packages with (tests/shims/README.md)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HERE = str(Path(__file__).resolve().parent)


def import_timm() -> ModuleType:
    """timm, imported beside the CPU torch.

    timm imports torchvision when it is imported. Where no torchvision is installed, the
    stand-in in this folder is put first on sys.path for that import alone and taken away
    again: timm keeps the few names it took from it, and nothing imported later (transformers,
    diffusers, which look for torchvision by name) finds a torchvision that is not there. An
    installed torchvision is imported as it is, and fails as it does."""
    if "timm" in sys.modules:
        return sys.modules["timm"]
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return importlib.import_module("timm")
    sys.path.insert(0, HERE)
    try:
        return importlib.import_module("timm")
    finally:
        sys.path.remove(HERE)
        for name in [n for n in sys.modules if n == "torchvision" or
                     n.startswith("torchvision.")]:
            del sys.modules[name]
