"""Weights, names: which name a checkpoint on disk gives each weight of a generated package.

A generated package knows its weights by the original model's state-dict names (PARAM_NAMES,
ALIASES): `model.model.layers.0.self_attn.q_proj.weight` for examples/hf.py, whose model wraps
a Hugging Face model in an attribute `model`. Files on disk name them in one of three ways,
each a convention here:

- "original": the original model's state-dict names (`model.state_dict()`, and what
  `atomc export` writes for a model that holds no transformers model);
- "transformers": names relative to the outermost transformers `PreTrainedModel` inside the
  original model, with the `base_layer` step that peft inserts into each layer it adapts
  removed: the names of the Hugging Face checkpoint the model is built from, and what
  `atomc export` writes for such a model;
- "peft": peft's own names for an adapter's weights (its adapter_model.safetensors), as
  `peft.get_peft_model_state_dict` gives them.

The conventions come from the original model built on the meta device from the package's
model file (no memory); without the model file only "original" is known, from the package.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch
from torch import nn

ORIGINAL, TRANSFORMERS, PEFT = "original", "transformers", "peft"


class SwapPackageLike(Protocol):
    """What atomc.weights reads of a generated package (atomc.runtime.package.SwapPackage).

    The runtime opens and exports checkpoints through this package (`weights=`,
    `save_pretrained`), so it sits below the runtime and names the attributes it reads
    instead of importing the runtime's type."""

    path: Path
    module: ModuleType
    plan: Any  # a PackagePlan: config, batch_size, options, model_path
    param_names: list[dict[str, str]]
    original_names: tuple[str, ...]
    build_submodels: Callable[..., list]
    export_state_dict: Callable[..., dict]

    def model_file(self) -> Path | None: ...

    @property
    def plan_hash(self) -> str: ...

    def initial_state_dict(self, seed: int) -> dict[str, torch.Tensor] | None: ...


@dataclass
class ModelNames:
    """A package's weights and the names files give them (see the module docstring)."""

    held: tuple[str, ...]  # the names the package holds (PARAM_NAMES), each once
    aliases: dict[str, str]  # another name of a tied weight -> the held name
    shapes: dict[str, tuple[int, ...]]  # held name -> shape, as the sub-models hold it
    model_names: tuple[str, ...]  # every state-dict name of the original model, in its order
    # convention -> file name -> original name
    conventions: dict[str, dict[str, str]] = field(default_factory=dict)
    adapter: frozenset[str] = frozenset()  # original names of a peft adapter's weights
    hf_model: nn.Module | None = None  # the transformers model inside, on meta
    hf_prefix: str = ""  # its path in the original model, with a trailing dot
    peft_model: nn.Module | None = None  # the peft model inside, on meta
    peft_prefix: str = ""
    # file names a checkpoint may hold that the model does not load, per convention: buffers
    # the model computes from its configuration (non-persistent ones), and what transformers
    # declares it ignores
    computed: dict[str, frozenset[str]] = field(default_factory=dict)
    ignore_patterns: tuple[str, ...] = ()  # transformers' _keys_to_ignore_on_load_unexpected

    def ignorable(self, convention: str, key: str) -> bool:
        """Whether tensor `key` of a file in `convention` is one the model does not load: a
        buffer it computes, under its name or under an older place of the same layer's buffer
        (checkpoints of older transformers carry `rotary_emb.inv_freq` in every layer, where
        the model now computes one for all), or a name transformers ignores."""
        computed = self.computed.get(convention, frozenset())
        if key in computed or ".".join(key.split(".")[-2:]) in {
                ".".join(n.split(".")[-2:]) for n in computed}:
            return True
        return convention == TRANSFORMERS and any(re.search(p, key)
                                                  for p in self.ignore_patterns)

    def canonical(self, name: str) -> str:
        """The held name of an original name (a tied weight's alias -> its held name)."""
        return self.aliases.get(name, name)

    def external(self, convention: str) -> dict[str, str]:
        """Original name -> its name in `convention` (the inverse of `conventions`)."""
        return {orig: ext for ext, orig in self.conventions.get(convention, {}).items()}


def package_names(pkg: SwapPackageLike, modules: list[nn.Module]) -> ModelNames:
    """The package's weights, their shapes (from `modules`, the package's sub-models, on any
    device) and every convention known for them."""
    held: dict[str, None] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for mod, names in zip(modules, pkg.param_names):
        params = dict(mod.named_parameters(remove_duplicate=False))
        bufs = dict(mod.named_buffers(remove_duplicate=False))
        for local, fqn in names.items():
            t = params.get(local, bufs.get(local))
            if t is None:
                continue
            held.setdefault(fqn)
            shapes.setdefault(fqn, tuple(t.shape))
    aliases = dict(getattr(pkg.module, "ALIASES", {}))
    order = pkg.original_names or tuple(held)
    names = ModelNames(tuple(held), aliases, shapes, tuple(order))
    model = build_on_meta(pkg)
    if model is not None:
        _add_model_conventions(names, model)
    else:
        names.conventions[ORIGINAL] = {n: n for n in (*names.model_names, *held, *aliases)}
    return names


def build_on_meta(pkg: SwapPackageLike) -> nn.Module | None:
    """The original model built from the package's model file on the meta device (no
    memory), or None when the model file is not found from here."""
    path = pkg.model_file()
    if path is None:
        return None
    from atomc.trace import build_and_inputs
    with torch.random.fork_rng(devices=[]):
        _, model, _ = build_and_inputs(path, pkg.plan.config, max(pkg.plan.batch_size, 1),
                                       dict(pkg.plan.options), "meta")
    return model


def _add_model_conventions(names: ModelNames, model: nn.Module) -> None:
    state = model.state_dict(keep_vars=True)
    names.model_names = tuple(state)
    names.conventions[ORIGINAL] = {n: n for n in (*state, *names.held)}
    persistent = set(state)
    computed = {n for n, _ in model.named_buffers(remove_duplicate=False) if n not in persistent}
    names.computed[ORIGINAL] = frozenset(computed)
    hf_prefix, hf_model = _outermost(model, _transformers_model_class())
    peft_prefix, peft_model = _outermost(model, _peft_model_class())
    if hf_model is not None:
        names.hf_model, names.hf_prefix = hf_model, hf_prefix
        wrappers = _peft_wrappers(model)
        names.conventions[TRANSFORMERS] = {
            _without_wrappers(n[len(hf_prefix):], wrappers, hf_prefix): n
            for n in state if n.startswith(hf_prefix)}
        names.computed[TRANSFORMERS] = frozenset(
            _without_wrappers(n[len(hf_prefix):], wrappers, hf_prefix)
            for n in computed if n.startswith(hf_prefix))
        names.ignore_patterns = tuple(getattr(hf_model, "_keys_to_ignore_on_load_unexpected",
                                              None) or ())
    if peft_model is not None:
        names.peft_model, names.peft_prefix = peft_model, peft_prefix
        adapter = _peft_adapter_names(peft_model, peft_prefix)
        names.conventions[PEFT] = adapter
        names.adapter = frozenset(adapter.values())


def _outermost(model: nn.Module, cls: type | None) -> tuple[str, nn.Module | None]:
    if cls is None:
        return "", None
    for path, mod in model.named_modules():
        if isinstance(mod, cls):
            return (f"{path}." if path else ""), mod
    return "", None


# A model holds a transformers or peft model only if its model file imported them: looked up
# among the imported modules, not imported here (transformers alone takes ~100 MB to import).


def _transformers_model_class() -> type | None:
    module = sys.modules.get("transformers")
    return getattr(module, "PreTrainedModel", None) if module is not None else None


def _peft_model_class() -> type | None:
    module = sys.modules.get("peft")
    return getattr(module, "PeftModel", None) if module is not None else None


def _peft_wrappers(model: nn.Module) -> list[str]:
    """Paths (with a trailing dot) of the layers peft wraps, each holding the original layer as
    `base_layer`; deepest first, so that nested wrappers unwrap from the inside."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer
    found = [f"{path}." for path, mod in model.named_modules()
             if isinstance(mod, BaseTunerLayer) and isinstance(getattr(mod, "base_layer", None),
                                                               nn.Module)]
    return sorted(found, key=len, reverse=True)


def _without_wrappers(relative: str, wrappers: list[str], prefix: str) -> str:
    name = prefix + relative
    for w in wrappers:
        if name.startswith(w + "base_layer."):
            name = w + name[len(w) + len("base_layer."):]
    return name[len(prefix):]


def _peft_adapter_names(peft_model: nn.Module, prefix: str) -> dict[str, str]:
    """peft's file name -> original name, for every weight of the peft model's adapter.

    peft renames the weights it saves (no adapter name, its own prefixes); which name becomes
    which is read off `get_peft_model_state_dict` itself, by tensor identity.
    """
    from peft import get_peft_model_state_dict
    state = peft_model.state_dict(keep_vars=True)
    by_id = {id(t): prefix + n for n, t in state.items()}
    adapter = get_peft_model_state_dict(peft_model, state_dict=state)
    return {k: by_id[id(t)] for k, t in adapter.items() if id(t) in by_id}


__all__ = ["ORIGINAL", "PEFT", "TRANSFORMERS", "ModelNames", "build_on_meta", "package_names"]
