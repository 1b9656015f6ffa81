"""What the stand-in's modules raise for a name they do not provide: an AttributeError where a
name is looked up (so `hasattr` says no, and `from torchvision.x import name` raises Python's
ImportError), an ImportError where a class timm names when it is imported is made."""

from __future__ import annotations

WHY = ("tests/shims/torchvision stands in for torchvision in the tests (the PyPI torchvision "
       "for torch 2.13 is a CUDA build that does not import beside the CPU torch) and provides "
       "only what timm needs to import and build models (tests/shims/README.md)")


def message(module: str, name: str) -> str:
    return (f"{module}.{name} is not available: {WHY}; install a torchvision built for this "
            f"torch to use it")


def module_getattr(module: str):
    """A module-level __getattr__ that refuses every name the module does not define."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(message(module, name))

    return __getattr__


def unavailable_class(module: str, name: str) -> type:
    """A class that timm's modules name (as a base class, in an import) when they are imported,
    but that raises ImportError when it is made: the tests never make one."""

    def __init__(self, *args, **kwargs):
        raise ImportError(message(module, name))

    return type(name, (), {"__init__": __init__, "__module__": module,
                           "__doc__": f"Not provided: making one raises ImportError. {WHY}."})
