"""Codegen's import resolution: the source expression that names a function or class from
the generated package (`F.relu`, `nn.Linear`, `transformers.activations.GELUActivation`), or
the model file's helper it must copy in.

A name is only written when a fresh interpreter elsewhere can import it: torch, the standard
library, an installed distribution, or a top-level function or class of the model file (which
`check.copy_helpers` brings into the package as `_helpers.py`).
"""

from __future__ import annotations

import builtins
import importlib
import importlib.metadata
import inspect
import math
import operator
import site
import sys
import sysconfig
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from atomc.errors import CodegenError
from atomc.trace import TracedModel
from atomc.trace.dynamic import autograd_function_of

# where a function is found first, how the package writes it and the import that needs
_WRITTEN_AS = ((F, "F.", "import torch.nn.functional as F"), (torch, "torch.", "import torch"),
               (builtins, "", ""), (operator, "operator.", "import operator"),
               (math, "math.", "import math"))


@cache
def _site_roots() -> tuple[Path, ...]:
    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(Path(path).resolve())
    try:
        roots.update(Path(p).resolve() for p in site.getsitepackages())
        roots.add(Path(site.getusersitepackages()).resolve())
    except AttributeError:  # virtualenvs with an old site module
        pass
    return tuple(sorted(roots))


@cache
def _distributed_packages() -> frozenset[str]:
    try:
        return frozenset(importlib.metadata.packages_distributions())
    except Exception:  # noqa: BLE001 - broken metadata of some unrelated distribution
        return frozenset()


def is_installed(module_name: str) -> bool:
    """True when a fresh interpreter elsewhere can import `module_name`: stdlib or installed."""
    top = module_name.split(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return True
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None) if module is not None else None
    if file is not None:
        path = Path(file).resolve()
        if any(path.is_relative_to(root) for root in _site_roots()):
            return True
    return top in _distributed_packages()


class Resolver:
    """Turns callables and classes into source expressions, and records needed helpers."""

    def __init__(self, traced: TracedModel):
        self.model_module: ModuleType = traced.module
        self.model_path = Path(getattr(traced.module, "__file__", "") or traced.graph.model_path)
        self.helpers: dict[str, Any] = {}  # name in the model file -> object
        self.helper_users: dict[str, str] = {}  # name -> what needed it (for error messages)

    def _describe(self, obj: Any) -> str:
        try:
            line = inspect.getsourcelines(obj)[1]
            return f"{getattr(obj, '__qualname__', obj)!s} ({self.model_path.name}:{line})"
        except (OSError, TypeError):
            return str(getattr(obj, "__qualname__", obj))

    def helper(self, obj: Any, why: str) -> str:
        """Name of a model-file function or class, to be copied into `_helpers.py`."""
        name = getattr(obj, "__name__", None)
        qualname = getattr(obj, "__qualname__", name) or ""
        if isinstance(obj, type(lambda: 0)) and name == "<lambda>":
            raise CodegenError(f"{why} calls a lambda ({self._describe(obj)}); atomc can only copy "
                               f"functions defined with def at the top level of "
                               f"{self.model_path.name}: give it a name with def")
        if "<locals>" in qualname:
            raise CodegenError(
                f"{why} uses {qualname}, which is defined inside another function (a closure over "
                f"its local state); atomc can only copy top-level functions and classes of "
                f"{self.model_path.name} into the generated package: move it to the top level")
        if name is None or getattr(self.model_module, name, None) is not obj or qualname != name:
            raise CodegenError(
                f"{why} uses {obj!r}, which is not a top-level function or class of "
                f"{self.model_path.name} under its own name; atomc cannot copy it into the "
                f"generated package: define it at the top level of the model file with def or "
                f"class")
        self.helpers[name] = obj
        self.helper_users.setdefault(name, why)
        return name

    def function(self, fn: Any, imports: set[str], why: str) -> str:
        if isinstance(fn, torch._ops.OpOverload):
            imports.add("import torch")
            return f"torch.ops.{fn}"
        if isinstance(fn, torch._ops.OpOverloadPacket):
            imports.add("import torch")
            return f"torch.ops.{fn}"
        if isinstance(fn, torch._ops.HigherOrderOperator):
            raise CodegenError(f"{why} calls the higher-order operator {fn}; atomc cannot "
                               f"generate code for it: avoid torch.cond/torch.no_grad regions "
                               f"inside forward")
        function = autograd_function_of(fn)
        if function is not None:  # a custom autograd.Function, kept whole by the tracer
            return f"{self.cls(function, imports, why)}.apply"
        name = getattr(fn, "__name__", None)
        module = getattr(fn, "__module__", None)
        if module == self.model_module.__name__ or name == "<lambda>":
            return self.helper(fn, why)
        if name is not None:
            for namespace, prefix, line in _WRITTEN_AS:
                if getattr(namespace, name, None) is fn:
                    if line:
                        imports.add(line)
                    return f"{prefix}{name}"
        if "<locals>" in (getattr(fn, "__qualname__", "") or ""):
            return self.helper(fn, why)
        try:
            path = fx.node._get_qualified_name(fn)
        except (RuntimeError, AttributeError, TypeError):
            path = None
        written = None if path is None else _written(path, fn)
        if written is None:
            raise CodegenError(
                f"{why} calls {fn!r}, which atomc cannot name from the generated package "
                f"(no importable module path); define it at the top level of the model file")
        expression, imported = written
        if path.split(".")[0] == "torch":
            imports.add("import torch")
            return expression
        mod_path = module if module and path.startswith(module + ".") else path.rpartition(".")[0]
        if mod_path in sys.modules and sys.modules[mod_path] is self.model_module:
            return self.helper(fn, why)
        if not is_installed(mod_path):
            where = getattr(sys.modules.get(mod_path), "__file__", "?")
            raise CodegenError(
                f"{why} calls {path}, defined in module {mod_path} ({where}), which is neither the "
                f"model file nor an installed package, so the generated package could not import "
                f"it on another machine; move the function into the model file or install its "
                f"module")
        imports.add(f"import {imported}")
        return expression

    def cls(self, klass: type, imports: set[str], why: str) -> str:
        name = klass.__name__
        if getattr(nn, name, None) is klass:
            imports.add("from torch import nn")
            return f"nn.{name}"
        if klass.__module__ == self.model_module.__name__:
            return self.helper(klass, why)
        if "<locals>" in klass.__qualname__:
            raise CodegenError(f"{why} uses class {klass.__qualname__}, which is defined inside a "
                               f"function; move it to the top level of the model file")
        module = klass.__module__
        if not is_installed(module):
            raise CodegenError(
                f"{why} uses class {module}.{klass.__qualname__}, defined in "
                f"{getattr(sys.modules.get(module), '__file__', '?')}, which is neither the model "
                f"file nor an installed package; move the class into the model file or install it")
        path = f"{module}.{klass.__qualname__}"
        written = _written(path, klass)
        if written is None:
            raise CodegenError(f"{why} uses class {path}, which cannot be imported under that name")
        expression, imported = written
        imports.add("import torch" if module.split(".")[0] == "torch" else f"import {imported}")
        return expression


def _written(path: str, obj: Any) -> tuple[str, str] | None:
    """(expression, module to import) that names `obj`, the dotted `path` where that works.

    Generated code evaluates `a.b.c.f` attribute by attribute from the package `a`, and a
    package may bind a submodule's name to something else: torchvision.ops imports the
    function stochastic_depth over its module torchvision.ops.stochastic_depth, so
    `torchvision.ops.stochastic_depth.stochastic_depth` fails where the import of its longest
    module prefix finds it. Then the same name under each enclosing package is tried,
    innermost first (`torchvision.ops.stochastic_depth`, the name the package exports)."""
    module = _module_prefix(path)
    if module is None:
        return None
    qualname = path.removeprefix(module + ".")
    parts = module.split(".")
    enclosing = [".".join(parts[:cut]) for cut in range(len(parts) - 1, 0, -1)]
    for candidate in [path, *(f"{m}.{qualname}" for m in enclosing)]:
        imported = _module_prefix(candidate)
        if imported is not None and _attributes(candidate) is obj:
            return candidate, imported
    return None


def _module_prefix(path: str) -> str | None:
    """The longest proper prefix of `path` that imports as a module."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:cut])
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not a module (or one that fails to import)
            continue
        return name
    return None


def _attributes(path: str) -> Any:
    """What `path` evaluates to as written, attribute by attribute from its top package
    (imported), or None."""
    parts = path.split(".")
    value: Any = sys.modules.get(parts[0])
    for attr in parts[1:]:
        value = getattr(value, attr, None)
        if value is None:
            return None
    return value
