"""Place stage input: the Network IR and the builders of DT-FM's network scenarios.

input:  a scenario name (DT-FM section 4.1, data in `scenarios.json`), a region list, or a JSON
        file {"devices": [...], "delay_ms": [[...]], "bandwidth_gbps": [[...]]}
output: a checked `Network` document (kind "atomc.network")

Delay is one-way latency in milliseconds, bandwidth is Gbit/s (10**9 bits per second). Row d,
column d' describes the link from device d to device d'; the cost model averages the two
directions into one symmetric communication graph, as DT-FM section 2 does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from atomc.errors import IRError, NetworkError
from atomc.ir.documents import SCHEMA_VERSION, Document
from atomc.jsonio import read_json

# The paper's intra-region link for individual GPUs in one cloud region (cases 4 and 5).
REGION_INTRA_DELAY_MS = 5.0
REGION_INTRA_BANDWIDTH_GBPS = 2.0


@dataclass(frozen=True)
class Device:
    name: str
    region: str  # the group it shares fast links with: instance, organization or cloud region
    gpu: str | None = None
    memory_bytes: int | None = None


@dataclass(frozen=True)
class Network(Document):
    KIND: ClassVar[str] = "atomc.network"

    devices: tuple[Device, ...]
    delay_ms: tuple[tuple[float, ...], ...]  # [d][d']: one-way delay from d to d'
    bandwidth_gbps: tuple[tuple[float, ...], ...]  # [d][d']: Gbit/s from d to d'
    name: str = ""
    description: str = ""

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def regions(self) -> list[str]:
        """Region names in order of first appearance."""
        seen: dict[str, None] = {}
        for d in self.devices:
            seen.setdefault(d.region, None)
        return list(seen)

    def check(self, source: str = "network") -> Network:
        """Raise NetworkError unless the matrices describe a usable communication graph."""
        n = len(self.devices)
        if n == 0:
            raise NetworkError(f"{source} has no devices; list at least one device under 'devices'")
        names = [d.name for d in self.devices]
        if any(not name for name in names):
            raise NetworkError(
                f"{source}: device {names.index('')} has an empty name; give every device a name"
            )
        if len(set(names)) != n:
            dup = sorted({x for x in names if names.count(x) > 1})
            raise NetworkError(
                f"{source}: device names {dup} appear more than once; names must be unique"
            )
        for d in self.devices:
            if d.memory_bytes is not None and d.memory_bytes < 0:
                raise NetworkError(
                    f"{source}: device {d.name} has memory_bytes {d.memory_bytes} < 0"
                )
        for field_name, rows in (
            ("delay_ms", self.delay_ms),
            ("bandwidth_gbps", self.bandwidth_gbps),
        ):
            _check_square(source, field_name, rows, n)
            values = np.asarray(rows, dtype=np.float64)
            bad = np.argwhere(~np.isfinite(values))
            if len(bad):
                i, j = bad[0]
                raise NetworkError(
                    f"{source}: {field_name}[{i}][{j}] is {values[i, j]}; expected a finite number"
                )
            bad = np.argwhere(values < 0)
            if len(bad):
                i, j = bad[0]
                raise NetworkError(
                    f"{source}: {field_name}[{i}][{j}] = {values[i, j]} is negative "
                    f"({names[i]} -> {names[j]}); delays and bandwidths must be >= 0"
                )
        # The diagonal is a device talking to itself: never used, so it may be 0. Both
        # directions of a link carry equal traffic (DT-FM sec. 2), so one dead direction stalls
        # the link as much as two.
        bandwidth = np.asarray(self.bandwidth_gbps, dtype=np.float64)
        bad = np.argwhere((bandwidth == 0) & ~np.eye(n, dtype=bool))
        if len(bad):
            i, j = bad[0]
            raise NetworkError(
                f"{source}: bandwidth_gbps[{i}][{j}] is 0 ({names[i]} -> {names[j]}); a link "
                f"that carries nothing makes every layout using it infinitely slow: give a "
                f"positive Gbit/s or leave one of the devices out"
            )
        return self

    def summary(self) -> str:
        """Short text form: devices per region and the range of link values between regions."""
        delay = symmetric(self.delay_ms)
        bandwidth = symmetric(self.bandwidth_gbps)
        regions = self.regions()
        index = {r: [i for i, d in enumerate(self.devices) if d.region == r] for r in regions}
        about = f": {self.description}" if self.description else ""
        lines = [
            (
                f"network {self.name or '(unnamed)'}: {self.num_devices} devices in "
                f"{len(regions)} region(s){about}"
            )
        ]
        width = max(len(r) for r in regions)
        lines.append(f"  {'region':<{width}}  devices  intra delay ms  intra Gbit/s")
        for r in regions:
            idx = index[r]
            if len(idx) > 1:
                sub_d = delay[np.ix_(idx, idx)][~np.eye(len(idx), dtype=bool)]
                sub_b = bandwidth[np.ix_(idx, idx)][~np.eye(len(idx), dtype=bool)]
                intra = f"{_span(sub_d):>14}  {_span(sub_b):>12}"
            else:
                intra = f"{'-':>14}  {'-':>12}"
            lines.append(f"  {r:<{width}}  {len(idx):>7}  {intra}")
        if len(regions) > 1:
            cross = np.array([[a != b for b in self._region_of()] for a in self._region_of()])
            lines.append(
                f"  between regions: delay {_span(delay[cross])} ms, "
                f"bandwidth {_span(bandwidth[cross])} Gbit/s"
            )
        return "\n".join(lines)

    def _region_of(self) -> list[str]:
        return [d.region for d in self.devices]


def _span(values: Any) -> str:
    lo, hi = float(values.min()), float(values.max())
    return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


def _check_square(
    source: str, field_name: str, rows: tuple[tuple[float, ...], ...], n: int
) -> None:
    if len(rows) != n:
        raise NetworkError(
            f"{source}: {field_name} has {len(rows)} rows but there are {n} devices; expected an "
            f"{n}x{n} matrix, one row and one column per device in the order of 'devices'"
        )
    for i, row in enumerate(rows):
        if len(row) != n:
            raise NetworkError(
                f"{source}: {field_name} row {i} has {len(row)} entries but there are {n} devices; "
                f"expected an {n}x{n} (square) matrix"
            )


def symmetric(rows: tuple[tuple[float, ...], ...]) -> Any:
    """The communication graph's value for each pair: the mean of both directions (DT-FM sec. 2)."""
    a = np.asarray(rows, dtype=np.float64)
    return (a + a.T) / 2.0


# ---------------------------------------------------------------------------------------------
# reading


def network_from_data(data: Any, source: str = "<data>") -> Network:
    """Network from parsed JSON; hand-written files may leave out kind and schema_version."""
    if isinstance(data, dict) and "kind" not in data and "devices" in data:
        data = {"kind": Network.KIND, "schema_version": SCHEMA_VERSION, **data}
    if isinstance(data, dict):
        # Matrices that are ragged or hold strings fail in from_data with a field path; a list
        # that is not a list of lists gets a shape message first, which says more.
        for key in ("delay_ms", "bandwidth_gbps"):
            rows = data.get(key)
            if isinstance(rows, list) and not all(isinstance(r, list) for r in rows):
                raise NetworkError(
                    f"{source}: {key} must be a list of rows (a square matrix), got {rows!r:.60}"
                )
    try:
        network = Network.from_json(data, source)
    except IRError as e:
        raise NetworkError(
            f'{e}; a network file is {{"devices": [{{"name": ..., "region": ...}}], '
            f'"delay_ms": [[...]], "bandwidth_gbps": [[...]]}}'
        ) from None
    return network.check(source)


def load_network(path: str | Path) -> Network:
    return network_from_data(read_json(path, Network.KIND), str(path))


# ---------------------------------------------------------------------------------------------
# builders


def scenario_data() -> dict[str, Any]:
    """The DT-FM scenario data shipped with the package (a copy of shared/dtfm/scenarios.json)."""
    text = resources.files("atomc.place").joinpath("scenarios.json").read_text()
    return json.loads(text)


def scenario_names() -> list[str]:
    return list(scenario_data()["cases"])


def resolve_scenario(name: str) -> str:
    """Full case key for '5', '5-worldwide' or 'worldwide'."""
    names = scenario_names()
    for key in names:
        number, _, rest = key.partition("-")
        if name in (key, number, rest):
            return key
    raise NetworkError(
        f"unknown network scenario {name!r}; expected one of {', '.join(names)} "
        f"(or its number), or build one with --regions"
    )


def build_scenario(name: str) -> Network:
    """One of DT-FM's five 64-GPU scenarios, with the intra/cross values of scenarios.json."""
    data = scenario_data()
    key = resolve_scenario(name)
    case = data["cases"][key]
    intra = (float(case["intra"]["delay_ms"]), float(case["intra"]["bandwidth_gbps"]))
    groups = [(g["name"], int(g["devices"])) for g in case["groups"]]

    if "cross_pairs" in case or case.get("cross") == "region_pairs":
        pairs = case["cross_pairs"] if "cross_pairs" in case else data["region_pairs"]["pairs"]
        table = _pair_table(pairs)

        def cross(a: str, b: str) -> tuple[float, float]:
            return table[(a, b)]
    else:
        value = (float(case["cross"]["delay_ms"]), float(case["cross"]["bandwidth_gbps"]))

        def cross(a: str, b: str) -> tuple[float, float]:
            return value
    # Every scenario in the paper runs on V100s (section 4.1).
    return _build(key, case.get("paper", ""), groups, intra, cross, gpu="V100")


def build_regions(
    specs: list[str],
    per_region: int = 8,
    intra_delay_ms: float = REGION_INTRA_DELAY_MS,
    intra_bandwidth_gbps: float = REGION_INTRA_BANDWIDTH_GBPS,
    name: str = "",
) -> Network:
    """Individual GPUs in the named cloud regions ('Tokyo', 'Tokyo:4'), linked by the measured
    region-pair values of DT-FM; inside a region the paper's 5 ms / 2 Gbit/s by default."""
    data = scenario_data()["region_pairs"]
    known = data["regions"]
    table = _pair_table(data["pairs"])
    groups: list[tuple[str, int]] = []
    for spec in [s for item in specs for s in item.split(",") if s.strip()]:
        region, _, count_text = spec.strip().partition(":")
        match = {r.lower(): r for r in known}.get(region.strip().lower())
        if match is None:
            raise NetworkError(f"unknown region {region!r}; expected one of {', '.join(known)}")
        try:
            count = int(count_text) if count_text else per_region
        except ValueError:
            raise NetworkError(
                f"region spec {spec!r}: {count_text!r} is not a device count; write e.g. Tokyo:8"
            ) from None
        if count <= 0:
            raise NetworkError(
                f"region spec {spec!r} asks for {count} devices; give a positive count"
            )
        if any(match == g for g, _ in groups):
            raise NetworkError(
                f"region {match} is listed twice; give it once with its device count "
                f"(e.g. {match}:16)"
            )
        groups.append((match, count))
    if not groups:
        raise NetworkError(
            f"--regions is empty; give regions such as Oregon:8,Tokyo:8 (known: {', '.join(known)})"
        )
    if intra_delay_ms < 0 or intra_bandwidth_gbps <= 0:
        raise NetworkError(
            f"intra-region delay {intra_delay_ms} ms / bandwidth {intra_bandwidth_gbps} Gbit/s: "
            f"expected a delay >= 0 and a bandwidth > 0"
        )
    label = name or "regions-" + "-".join(f"{g}{c}" for g, c in groups)
    description = (
        f"individual GPUs in {len(groups)} region(s); {intra_delay_ms:g} ms and "
        f"{intra_bandwidth_gbps:g} Gbit/s inside a region; measured AWS values between regions"
    )
    return _build(
        label,
        description,
        groups,
        (intra_delay_ms, intra_bandwidth_gbps),
        lambda a, b: table[(a, b)],
        gpu=None,
    )


def _pair_table(pairs: dict[str, Any]) -> dict[tuple[str, str], tuple[float, float]]:
    table = {}
    for key, value in pairs.items():
        a, b = key.split("-")
        entry = (float(value["delay_ms"]), float(value["bandwidth_gbps"]))
        table[(a, b)] = table[(b, a)] = entry
    return table


def _build(name, description, groups, intra, cross, gpu) -> Network:
    devices = tuple(
        Device(name=f"{g}/{k}", region=g, gpu=gpu) for g, count in groups for k in range(count)
    )
    delay, bandwidth = [], []
    for a in devices:
        row_d, row_b = [], []
        for b in devices:
            if a.region == b.region:
                d, bw = intra
            else:
                d, bw = cross(a.region, b.region)
            row_d.append(0.0 if a is b else d)
            row_b.append(bw)
        delay.append(tuple(row_d))
        bandwidth.append(tuple(row_b))
    return Network(
        devices=devices,
        delay_ms=tuple(delay),
        bandwidth_gbps=tuple(bandwidth),
        name=name,
        description=description,
    ).check(name)
