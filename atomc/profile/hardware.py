"""Hardware profiles shipped in profiles/ (installed as the package atomc.profiles)."""

from __future__ import annotations

import json
from importlib import resources

from atomc.errors import ProfileError
from atomc.ir import HardwareProfile
from atomc.ir.documents import from_data


def _files():
    return resources.files("atomc.profiles")


def hardware_names() -> list[str]:
    return sorted(f.name.removesuffix(".json") for f in _files().iterdir()
                  if f.name.endswith(".json"))


def load_hardware(name: str) -> HardwareProfile:
    names = hardware_names()
    if name not in names:
        raise ProfileError(f"unknown hardware profile {name!r}; valid names: {', '.join(names)} "
                           f"(see `atomc profiles`)")
    source = _files() / f"{name}.json"
    try:
        data = json.loads(source.read_text())
    except json.JSONDecodeError as e:
        raise ProfileError(f"hardware profile {name} is not valid JSON: {e}") from None
    return from_data(HardwareProfile, data, f"profiles/{name}.json")
