"""Layout runner, placement: a Layout and the launched world -> this rank's tasklet and its groups.

input:  a DT-FM layout (D_PP stages x D_DP replicas, rank = replica * D_PP + stage, each stage a
        range of the plan's sub-models, each tasklet on a device of the network) and the world
        torchrun launched (RANK, WORLD_SIZE, and optionally ATOMC_DEVICE: the device this process
        runs on)
output: a `Placement` (this rank's (replica, stage), its sub-model range, the world rank of every
        tasklet) and, once torch.distributed is up, a `Groups` (data-parallel group of the stage,
        pipeline group of the replica, groups of the stages that hold a tied weight, and one
        group per direction of each pipeline link)

A layout names *logical* ranks; torchrun hands out *world* ranks (on several machines in
rendezvous order). When every process says which device it runs on (ATOMC_DEVICE), tasklets
follow devices: the tasklet the layout put on device d runs on the process that claims d.
Otherwise logical rank = world rank, which is what one machine with one process per tasklet gets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atomc.errors import LayoutError


@dataclass(frozen=True)
class LayoutView:
    """What the runner needs from a Layout document (see `layout_view`)."""

    pp: int  # D_PP: pipeline stages
    dp: int  # D_DP: data-parallel replicas
    stage_ranges: tuple[tuple[int, int], ...]  # stage -> sub-models [start, stop)
    devices: tuple[tuple[str, ...], ...]  # [replica][stage] -> device name
    plan_hash: str = ""  # the plan the stage ranges cut ("" when the layout does not say)
    num_submodels: int = 0  # sub-models of that plan (0: unknown)
    # one-way delay (ms) and bandwidth (Gbit/s) between devices, when the layout carries its network
    delay_ms: dict[tuple[str, str], float] = field(default_factory=dict)
    bandwidth_gbps: dict[tuple[str, str], float] = field(default_factory=dict)
    # device -> its memory, for the devices whose network entry gives `memory_bytes`
    memory_bytes: dict[str, int] = field(default_factory=dict)
    predicted: dict[str, float] = field(default_factory=dict)  # atomc place's cost, seconds
    source: str = "<layout>"
    digest: str = ""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.pp + stage

    def tasklet(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.pp)

    def device_of(self, rank: int) -> str:
        replica, stage = self.tasklet(rank)
        return self.devices[replica][stage]

    def text(self) -> str:
        """Short text form: the replica x stage grid of devices and sub-model ranges."""
        width = max(len(d) for row in self.devices for d in row)
        head = "          " + "  ".join(
            f"stage {j} [{a}:{b})".ljust(width) for j, (a, b) in enumerate(self.stage_ranges))
        rows = [f"replica {i} " + "  ".join(d.ljust(max(width, len(f"stage {j} [00:00)")))
                                           for j, d in enumerate(row))
                for i, row in enumerate(self.devices)]
        return "\n".join([f"layout {self.source}: {self.pp} stages x {self.dp} replicas", head,
                          *rows])

    def check(self, num_submodels: int | None = None) -> LayoutView:
        where = self.source
        if self.pp < 1 or self.dp < 1:
            raise LayoutError(f"{where}: D_PP={self.pp}, D_DP={self.dp}; both must be at least 1")
        if self.stage_ranges and len(self.stage_ranges) != self.pp:
            raise LayoutError(f"{where}: {len(self.stage_ranges)} stage ranges for {self.pp} "
                              f"stages; expected one sub-model range per stage: rerun "
                              f"`atomc place`")
        expect = 0
        for j, (a, b) in enumerate(self.stage_ranges):
            if a != expect or b <= a:
                raise LayoutError(f"{where}: stage {j} covers sub-models [{a}, {b}); stages must "
                                  f"cover consecutive non-empty ranges starting at {expect}: "
                                  f"rerun `atomc place`")
            expect = b
        if len(self.devices) != self.dp or any(len(row) != self.pp for row in self.devices):
            raise LayoutError(f"{where}: the device matrix is not {self.dp} replicas x {self.pp} "
                              f"stages")
        flat = [d for row in self.devices for d in row]
        if len(set(flat)) != len(flat):
            dup = sorted({d for d in flat if flat.count(d) > 1})
            raise LayoutError(f"{where}: devices {dup} run more than one tasklet; a layout puts "
                              f"one tasklet on each device")
        n = num_submodels if num_submodels is not None else self.num_submodels
        if n and expect != n:
            raise LayoutError(f"{where}: the stages cover sub-models [0, {expect}) but the plan "
                              f"has {n}; the layout was placed for another plan: rerun "
                              f"`atomc place` with this plan")
        return self


def layout_view(obj: Any, source: str = "<layout>", network: Any = None) -> LayoutView:
    """A LayoutView from an `atomc.place` Layout document, its file, or a LayoutView.

    `network` (a Network or its file) adds the link delays and bandwidths and the devices'
    memory; it must be the network the layout was placed on.
    """
    if isinstance(obj, LayoutView):
        return obj
    if isinstance(obj, (str, Path)):
        return load_layout(obj, network)
    from atomc.place.layout import Layout

    if isinstance(obj, Layout):
        return _from_document(obj, source, network)
    raise LayoutError(f"{source}: expected a Layout, got {type(obj).__name__}")


def load_layout(path: str | Path, network: Any = None) -> LayoutView:
    from atomc.errors import IRError
    from atomc.place.layout import Layout

    p = Path(path)
    if not p.is_file():
        raise LayoutError(f"layout file {p} does not exist; write one with "
                          f"`atomc place NET.json --pp P --dp D --plan PLAN.json -o {p}`")
    try:
        doc = Layout.load(p)
    except IRError as e:
        raise LayoutError(f"{e}; give the layout `atomc place` wrote") from None
    return _from_document(doc, str(p), network)


def _from_document(doc: Any, source: str, network: Any = None) -> LayoutView:
    from atomc.place.network import Network, load_network

    try:
        doc.check(source=source)
    except LayoutError as e:
        raise LayoutError(f"{e}; place again") from None
    pp, dp = int(doc.num_stages), int(doc.num_replicas)
    devices = tuple(tuple(doc.devices[j][i] for j in range(pp)) for i in range(dp))
    ranges = tuple(tuple(st.submodels) for st in doc.stages) if all(
        st.submodels is not None for st in doc.stages) else ()
    delay, bandwidth, memory = {}, {}, {}
    if network is not None:
        net = network if isinstance(network, Network) else load_network(network)
        if net.content_hash() != doc.network_hash:
            raise LayoutError(f"{source} was placed on network {doc.network_name} "
                              f"({doc.network_hash}), but the network given is "
                              f"{net.name or '(unnamed)'} ({net.content_hash()}); "
                              f"give the network file the layout was placed on")
        names = [d.name for d in net.devices]
        for a, na in enumerate(names):
            for b, nb in enumerate(names):
                if a != b:
                    delay[(na, nb)] = float(net.delay_ms[a][b])
                    bandwidth[(na, nb)] = float(net.bandwidth_gbps[a][b])
        memory = {d.name: int(d.memory_bytes) for d in net.devices if d.memory_bytes is not None}
    predicted = {"dp_s": doc.cost.dp_s, "pp_s": doc.cost.pp_s, "total_s": doc.cost.total_s}
    view = LayoutView(pp=pp, dp=dp, stage_ranges=ranges, devices=devices,
                      plan_hash=doc.plan_hash or "", delay_ms=delay, bandwidth_gbps=bandwidth,
                      memory_bytes=memory, predicted=predicted, source=source,
                      digest=doc.content_hash())
    return view.check() if ranges else view


def with_ranges(view: LayoutView, plan: Any) -> LayoutView:
    """A layout placed without a plan gets the stage ranges `atomc place --plan` would have
    chosen (compute-balanced consecutive sub-models), from the package's own plan."""
    if view.stage_ranges:
        return view
    from dataclasses import replace

    from atomc.place.cost import stage_ranges

    return replace(view, stage_ranges=tuple(stage_ranges(plan, view.pp))).check(len(plan.submodels))


# ---------------------------------------------------------------------------------------------
# this process in the layout


@dataclass(frozen=True)
class Placement:
    layout: LayoutView
    rank: int  # logical rank: replica * D_PP + stage
    world_rank: int
    world_of: tuple[int, ...]  # logical rank -> world rank

    @property
    def replica(self) -> int:
        return self.layout.tasklet(self.rank)[0]

    @property
    def stage(self) -> int:
        return self.layout.tasklet(self.rank)[1]

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def submodels(self) -> tuple[int, int]:
        return self.layout.stage_ranges[self.stage]

    @property
    def device_name(self) -> str:
        return self.layout.device_of(self.rank)

    def world(self, replica: int, stage: int) -> int:
        return self.world_of[self.layout.rank(replica, stage)]

    @property
    def prev(self) -> int | None:
        """World rank of the previous stage of this replica (None on the first stage)."""
        return self.world(self.replica, self.stage - 1) if self.stage > 0 else None

    @property
    def next(self) -> int | None:
        return self.world(self.replica, self.stage + 1) if self.stage < self.pp - 1 else None

    def link_delay_ms(self, other_world_rank: int) -> float:
        other = self.world_of.index(other_world_rank)
        return self.layout.delay_ms.get((self.device_name, self.layout.device_of(other)), 0.0)

    def describe(self) -> str:
        a, b = self.submodels
        return (f"rank {self.world_rank}: replica {self.replica}, stage {self.stage} of "
                f"{self.pp}x{self.dp}, sub-models [{a}, {b}), device {self.device_name}")


def check_world(layout: LayoutView, world_size: int, rank: int) -> None:
    """Before any rendezvous: the launched world must be the layout's."""
    if world_size != layout.world_size:
        raise LayoutError(
            f"{layout.source} has {layout.pp} stages x {layout.dp} replicas = {layout.world_size} "
            f"tasklets, but this job was launched with world size {world_size}; launch exactly "
            f"{layout.world_size} processes (`atomc launch {layout.source} -- SCRIPT` prints the "
            f"command)")
    if not 0 <= rank < layout.world_size:
        raise LayoutError(
            f"rank {rank} is outside {layout.source}, whose ranks are 0..{layout.world_size - 1} "
            f"(rank = replica * {layout.pp} + stage); launch with RANK in that range")


def assign(layout: LayoutView, world_size: int, world_rank: int,
           claims: list[str | None] | None = None) -> Placement:
    """Map world ranks to tasklets. `claims[r]` is the device world rank r runs on, if known."""
    check_world(layout, world_size, world_rank)
    if claims is None or all(c is None for c in claims):
        return Placement(layout, world_rank, world_rank, tuple(range(world_size)))
    if any(c is None for c in claims):
        missing = [r for r, c in enumerate(claims) if c is None]
        raise LayoutError(f"ranks {missing} did not say which device they run on while others did; "
                          f"set ATOMC_DEVICE for every process or for none")
    logical_of_device = {layout.device_of(r): r for r in range(layout.world_size)}
    unknown = sorted({c for c in claims if c not in logical_of_device})
    if unknown:
        raise LayoutError(f"devices {unknown} (ATOMC_DEVICE) are not in {layout.source}, whose "
                          f"devices are {sorted(logical_of_device)}; the rank is outside the "
                          f"layout: run it on a device the layout names")
    dup = sorted({c for c in claims if claims.count(c) > 1})
    if dup:
        raise LayoutError(f"devices {dup} are claimed by more than one process; give each process "
                          f"its own ATOMC_DEVICE")
    world_of = [0] * world_size
    for r, c in enumerate(claims):
        world_of[logical_of_device[c]] = r
    return Placement(layout, logical_of_device[claims[world_rank]], world_rank, tuple(world_of))


# ---------------------------------------------------------------------------------------------
# process groups


@dataclass
class Groups:
    """torch.distributed groups of one rank (every rank creates every group, in one order)."""

    dp: Any  # this stage's replicas
    pipeline: Any  # this replica's stages
    tied: dict[tuple[int, ...], Any]  # stage set -> this replica's group over those stages
    dp_ranks: tuple[int, ...]
    pipeline_ranks: tuple[int, ...]
    # (source, destination) world ranks -> the group of that direction of a pipeline link, for
    # the links this rank is on: activations stage j -> j+1, gradients j+1 -> j (pipeline.py)
    links: dict[tuple[int, int], Any] = field(default_factory=dict)


def build_groups(placement: Placement, tied_stage_sets: list[tuple[int, ...]]) -> Groups:
    """New groups for data parallelism, pipelines, tied weights and pipeline links (collective
    over the world: every rank creates every group, in the same order)."""
    import torch.distributed as dist

    lay = placement.layout
    dp_group = pipe_group = None
    dp_ranks: tuple[int, ...] = ()
    pipe_ranks: tuple[int, ...] = ()
    for j in range(lay.pp):
        ranks = tuple(placement.world(i, j) for i in range(lay.dp))
        g = _new_group(dist, ranks)
        if j == placement.stage:
            dp_group, dp_ranks = g, ranks
    for i in range(lay.dp):
        ranks = tuple(placement.world(i, j) for j in range(lay.pp))
        g = _new_group(dist, ranks)
        if i == placement.replica:
            pipe_group, pipe_ranks = g, ranks
    tied: dict[tuple[int, ...], Any] = {}
    for stages in sorted(set(tied_stage_sets)):
        if len(stages) < 2:
            continue
        for i in range(lay.dp):
            g = _new_group(dist, tuple(placement.world(i, j) for j in stages))
            if i == placement.replica and placement.stage in stages:
                tied[stages] = g
    return Groups(dp_group, pipe_group, tied, dp_ranks, pipe_ranks, link_groups(placement, dist))


def link_directions(layout: LayoutView, world: Any) -> list[tuple[int, int]]:
    """Every direction of every pipeline link as (source, destination) world ranks, in the order
    the groups are created: replica by replica, stage boundary by boundary, activations (j ->
    j+1) then gradients (j+1 -> j). `world(replica, stage)` gives a tasklet's world rank."""
    out = []
    for i in range(layout.dp):
        for j in range(layout.pp - 1):
            a, b = world(i, j), world(i, j + 1)
            out += [(a, b), (b, a)]
    return out


def link_groups(placement: Placement, dist: Any) -> dict[tuple[int, int], Any]:
    """One two-rank group per direction of each pipeline link (collective over the world).

    NCCL runs all sends and receives between two ranks of one group on one stream, in issue
    order, ignoring tags: with both directions in one group, a gradient receive posted ahead
    would block the activations behind it (and the other rank the same way round). A group of
    its own gives each direction its own communicator and stream, where FIFO order is right.
    """
    out = {}
    for src, dst in link_directions(placement.layout, placement.world):
        g = _new_group(dist, (src, dst))
        if placement.world_rank in (src, dst):
            out[(src, dst)] = g
    return out


def _new_group(dist: Any, ranks: tuple[int, ...]) -> Any:
    # sorted: torch wants the same list on every rank; order inside a group does not matter to us
    return dist.new_group(sorted(ranks))


def device_claim() -> str | None:
    """The device this process runs on, as the layout names it: ATOMC_DEVICE, or the
    LOCAL_RANK-th name of ATOMC_DEVICES (a comma-separated list, one per local process)."""
    value = os.environ.get("ATOMC_DEVICE", "").strip()
    if value:
        return value
    names = [n.strip() for n in os.environ.get("ATOMC_DEVICES", "").split(",") if n.strip()]
    if not names:
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= len(names):
        raise LayoutError(f"ATOMC_DEVICES lists {len(names)} devices but this is local process "
                          f"{local}; list one device per process on this machine")
    return names[local]
