"""Stages, the cut: which values cross each boundary between stages, and the `StageSpec` of each
stage of a generated package cut at given sub-model ranges."""

from __future__ import annotations

from pathlib import Path

from atomc.errors import RuntimeMismatchError
from atomc.ir import Plan
from atomc.runtime.package import SwapPackage
from atomc.stages.base import StageSpec


def stage_boundaries(inputs: list[tuple[str, ...]], outputs: list[tuple[str, ...]],
                     model_inputs: tuple[str, ...], ranges: tuple[tuple[int, int], ...]
                     ) -> list[tuple[str, ...]]:
    """Names stage j sends to stage j+1: every value available on stage j (produced there or
    received) that a later stage reads. Model inputs are not sent: every rank reads the batch."""
    produced_by: dict[str, int] = {}
    for i, names in enumerate(outputs[:-1]):
        for n in names:
            produced_by.setdefault(n, i)
    sends: list[tuple[str, ...]] = []
    for _, b in ranges[:-1]:
        later = [n for i in range(b, len(inputs)) for n in inputs[i]]
        names: list[str] = []
        for n in later:
            if n in model_inputs or n in names:
                continue
            if produced_by.get(n, len(inputs)) < b:
                names.append(n)
        sends.append(tuple(names))
    return sends


def cut_stages(pkg: SwapPackage, ranges: tuple[tuple[int, int], ...]) -> list[StageSpec]:
    """The stages of `pkg` cut at `ranges` (stage j: sub-models [a, b)), with what each
    receives from the one before and sends to the one after."""
    sends = stage_boundaries(pkg.inputs, pkg.outputs, pkg.model_inputs, ranges)
    n = len(ranges)
    return [StageSpec(j, n, a, b, sends[j - 1] if j > 0 else (), sends[j] if j < n - 1 else (),
                      j == n - 1, pkg.num_submodels) for j, (a, b) in enumerate(ranges)]


def package_plan(pkg: SwapPackage) -> Plan:
    """The Plan the package was generated from (its plan.json)."""
    path = Path(pkg.path) / "plan.json"
    if not path.is_file():
        raise RuntimeMismatchError(f"{pkg.path} has no plan.json; regenerate the package with "
                                   f"`atomc codegen`")
    return Plan.load(path)


__all__ = ["cut_stages", "package_plan", "stage_boundaries"]
