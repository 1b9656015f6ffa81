"""Host memory of a swap run: the bytes the runtime allocates on the host, by kind.

One formula for the plan (`atomc partition` states and checks it against `--host-mem`), for
`atomc train`'s check before it pins anything, and for the runtime's own allocations
(atomc.runtime.store.HostStore, atomc.runtime.cpuoptimizer.CpuOptimizer size their buffers with
the functions here), so the plan's figure is what the run takes.

Only AdamW's state lives for the whole step: the masters and the two moments. How the store
keeps the masters beside the images the GPU loads (atomc.runtime.masters.store_mode):
"direct" (the same dtype: the image is the master), "split" (float32 masters, bfloat16 images:
the image is each master's high half and a 2-byte residual its low half, so a weight costs 4
bytes for both), "separate" (float16 images: a float32 master of its own).

Kinds (bytes):
- `masters`: what the masters take beyond the images: nothing (direct), the residuals
  (split: 2 bytes per owned weight), or the float32 masters (separate); frozen weights
  included.
- `optimizer_states`: AdamW's two moments per trainable weight, in the master dtype (or
  bfloat16 with `--optimizer-states bfloat16`), plus, where the update cannot run on plain
  master-dtype tensors (split or separate masters, bfloat16 moments), the scratch it computes
  in a chunk at a time: master, gradient and two moments, UPDATE_CHUNK elements each at most
  (`update_scratch_numel`); frozen weights have none.
- `transfer_copies`: the images the GPU loads in one copy per sub-model (the transfer dtype,
  tied replicas included), in one arena, page-locked where it lies on CUDA (no rounding).
- `gradient_buffers`: the pinned arena the gradients come back into (trainable weights only):
  one buffer per sub-model where every gradient must be in before any update (clipping, fp16
  loss scaling), else a ring of `grad_slots` buffers of the largest sub-model's size, taken
  when a sub-model's gradients arrive and given back when its update has consumed them; with
  a ring, the tied weights' gradient sums in the master dtype (their holders give their
  buffers back before the owner's update).
- `activation_stash`: boundary values kept on the host between forward and backward
  (offloaded checkpoints; recompute only), C micro-batches, pinned.
- `activations_sent`: heavy operators' outputs sent to host memory between forward and backward
  (activations="auto": Submodel.sent_bytes), C micro-batches, pinned.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from atomc.errors import UsageError
from atomc.ir import DiskSpec, HostMemory, OpGraph, Plan, Profile, Submodel
from atomc.units import format_bytes, parse_size

ARENA_ALIGN = 512  # bytes: where each buffer of an arena starts; a multiple of every dtype's size
MOMENTS_PER_WEIGHT = 2  # AdamW: exp_avg and exp_avg_sq
# elements of the update's scratch buffers (master, gradient, two moments), a chunk at a time:
# 4 x 4 MiB stays in a CPU's cache between the widening copies, the update and the narrowing
# ones (a shared 2-core EPYC, 16.8M weights, bfloat16 moments: 2.6-2.9 GB/s of fp32 masters
# per CPU-second in chunks of 1M, 1.7-2.1 in one piece; docs/runtime.md). A multiple of 64: a
# weight split there keeps every element on the same (vector or scalar) path of the CPU
# kernels: the same bits.
UPDATE_CHUNK = 1 << 20
UPDATE_SCRATCH_BUFFERS = 4  # master, gradient, exp_avg, exp_avg_sq
OPTIMIZER_STATES = ("float32", "bfloat16")
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
KINDS = ("masters", "optimizer_states", "transfer_copies", "gradient_buffers",
         "activation_stash", "activations_sent", "disk_staging")
KIND_WORDS = {"masters": "masters beyond the images", "optimizer_states": "optimizer moments",
              "transfer_copies": "pinned transfer images", "gradient_buffers": "gradient buffers",
              "activation_stash": "activation stash",
              "activations_sent": "activations sent to host",
              "disk_staging": "disk staging buffers"}
# the disk tier (atomc.runtime.tier): the kinds of a sub-model's states a plan puts on disk, in
# the order it moves them there (each costs one read and one write a step; an image also one
# or two reads for its loads); the record of a sub-model's states on disk, each region
# ALIGN-aligned; the host buffers they pass through
DISK_KINDS = ("moments", "masters", "images")
DISK_ALIGN = 4096  # direct I/O's alignment of offsets, lengths and buffers
STAGING_SLOTS = 3  # segments: read ahead, being updated, written behind
DISK_SEGMENT = 1 << 24  # master elements a record streams in at most (and one update chunk)
IMAGE_SLOTS = 3  # images from disk: the load being copied and two read ahead


def arena_bytes(nbytes: Sequence[int]) -> int:
    """Bytes one arena of buffers of these sizes spans (each starts at ARENA_ALIGN)."""
    end = 0
    for n in nbytes:
        end = -(-end // ARENA_ALIGN) * ARENA_ALIGN + n
    return end


@dataclass(frozen=True)
class SubmodelWeights:
    """One sub-model's weights as the host store lays them out, in elements."""

    image: int  # what it loads: owned weights and tied replicas (wide weights: their span)
    owned: int  # the masters it owns (frozen included)
    trainable: int  # owned trainable weights: gradients, moments, updates
    grad: int  # its gradient buffer (trainable owned and replicas; wide: their span)
    shared: int = 0  # owned trainable weights that later sub-models hold replicas of (ties)
    replicas: int = 0  # image elements of tied weights owned by an earlier sub-model


def moment_bytes(states: str, master_dtype: str = "float32") -> int:
    """Bytes of one moment: the master dtype's ("float32": the masters' own; a float64 run's
    moments are float64), or bfloat16's."""
    if states not in OPTIMIZER_STATES:
        raise UsageError(f"--optimizer-states {states!r} is not one of "
                         f"{', '.join(OPTIMIZER_STATES)}; give float32 (default) or bfloat16 "
                         f"(half the optimizer's host memory)")
    return DTYPE_BYTES[master_dtype] if states == "float32" else DTYPE_BYTES[states]


def store_mode(master_dtype: str, transfer_dtype: str) -> str:
    """"direct", "split" or "separate" (see the module docstring; the runtime's
    atomc.runtime.masters.store_mode, by dtype names)."""
    if master_dtype == transfer_dtype:
        return "direct"
    if master_dtype == "float32" and transfer_dtype == "bfloat16":
        return "split"
    return "separate"


def update_scratch_numel(trainable: Sequence[int]) -> int:
    """Elements of each scratch buffer the chunked update computes in: a chunk, or the largest
    sub-model's trainable weights when they are fewer."""
    return min(UPDATE_CHUNK, max(trainable, default=0))


def chunked_update(master_dtype: str, transfer_dtype: str, optimizer_states: str) -> bool:
    """Whether the update runs a chunk at a time in scratch (atomc.runtime.adamw.ChunkedAdamW):
    unless masters, gradients and moments are all plain master-dtype tensors."""
    return store_mode(master_dtype, transfer_dtype) != "direct" or optimizer_states != "float32"


def aligned(nbytes: int) -> int:
    return -(-nbytes // DISK_ALIGN) * DISK_ALIGN


def states_by_kind(sub: SubmodelWeights, master_dtype: str, transfer_dtype: str,
                optimizer_states: str) -> dict[str, int]:
    """One sub-model's states by the kinds the disk tier moves (DISK_KINDS): its image, its
    masters beyond the image, its two moments."""
    mode = store_mode(master_dtype, transfer_dtype)
    beyond = {"direct": 0, "split": 2, "separate": DTYPE_BYTES[master_dtype]}[mode]
    return {"images": sub.image * DTYPE_BYTES[transfer_dtype], "masters": sub.owned * beyond,
            "moments": MOMENTS_PER_WEIGHT * sub.trainable
                       * moment_bytes(optimizer_states, master_dtype)}


def record_bytes(states: dict[str, int], kinds: frozenset[str] | set[str]) -> int:
    """Bytes of a sub-model's record of the kinds on disk (atomc.runtime.tier's layout: its
    image, masters, then each moment, every region DISK_ALIGN-aligned)."""
    parts = []
    if "images" in kinds:
        parts.append(states["images"])
    if "masters" in kinds and states["masters"]:
        parts.append(states["masters"])
    if "moments" in kinds:
        parts += [states["moments"] // MOMENTS_PER_WEIGHT] * MOMENTS_PER_WEIGHT
    return sum(aligned(n) for n in parts)


def segment_bytes(sub: SubmodelWeights, states: dict[str, int],
                  kinds: frozenset[str] | set[str]) -> int:
    """Bytes one staged segment of a sub-model's record takes at most (atomc.runtime.tier's
    segments: DISK_SEGMENT master elements and up to one update chunk more, each region's
    span aligned outwards), or its whole record where that is smaller."""
    elems = DISK_SEGMENT + UPDATE_CHUNK
    parts = []
    if "images" in kinds:  # image positions per master element: wide weights' spans too
        parts.append((states["images"], min(sub.image, sub.owned or sub.image)))
    if "masters" in kinds and states["masters"]:
        parts.append((states["masters"], sub.owned))
    if "moments" in kinds:
        parts += [(states["moments"] // MOMENTS_PER_WEIGHT, sub.trainable)] * MOMENTS_PER_WEIGHT
    return sum(min(aligned(n), aligned(-(-n * elems // numel)) + DISK_ALIGN)
               for n, numel in parts if numel)


@dataclass(frozen=True)
class _SubmodelHost:
    """One sub-model's share of a run's host bytes, given the kinds of its states on disk."""

    image: int | None  # its transfer image held on the host (None: on disk)
    masters: int  # masters beyond the image held on the host
    moments: int  # moments held on the host
    staged: int  # the largest segment of its record that staging passes (0: nothing on disk)
    disk_image: int  # its image bytes on disk (0: none)
    on_disk: bool  # any of its states on disk


def _submodel_host(sub: SubmodelWeights, states: dict[str, int],
                   kinds: frozenset[str] | set[str]) -> _SubmodelHost:
    return _SubmodelHost(
        image=None if "images" in kinds else states["images"],
        masters=0 if "masters" in kinds else states["masters"],
        moments=0 if "moments" in kinds else states["moments"],
        staged=segment_bytes(sub, states, kinds),
        disk_image=states["images"] if "images" in kinds else 0, on_disk=bool(kinds))


@dataclass(frozen=True)
class _Shares:
    """The sub-models' shares summed as host_bytes_by_kind counts them: sums, the largest
    staged segment and disk image, and the arena of the images kept on the host."""

    masters: int
    moments: int
    staged: int
    disk_image: int
    on_disk: bool
    image_arena: int

    @classmethod
    def of(cls, parts: Sequence[_SubmodelHost]) -> _Shares:
        return cls(sum(p.masters for p in parts), sum(p.moments for p in parts),
                   max((p.staged for p in parts), default=0),
                   max((p.disk_image for p in parts), default=0),
                   any(p.on_disk for p in parts),
                   arena_bytes([p.image for p in parts if p.image is not None]))

    def moved(self, old: _SubmodelHost, new: _SubmodelHost,
              parts: Sequence[_SubmodelHost]) -> _Shares:
        """The shares once one sub-model's share went from `old` to `new` (`parts`: every
        share, the new one in place) by moving more of its states to disk: its staged segment
        and disk image only grow then, so the largest stay maxima."""
        return _Shares(self.masters - old.masters + new.masters,
                       self.moments - old.moments + new.moments,
                       max(self.staged, new.staged), max(self.disk_image, new.disk_image),
                       self.on_disk or new.on_disk,
                       self.image_arena if old.image == new.image else
                       arena_bytes([p.image for p in parts if p.image is not None]))


def host_bytes_by_kind(subs: Sequence[SubmodelWeights], master_dtype: str, transfer_dtype: str,
                       optimizer_states: str = "float32",
                       stash_bytes: int = 0, sent_bytes: int = 0,
                       grad_slots: int | None = None,
                       disk_kinds: Sequence[frozenset[str] | set[str]] = ()) -> dict[str, int]:
    """Host bytes of a swap run by kind (see the module docstring); the runtime's sizes.
    `grad_slots`: a ring of that many gradient buffers (None or k and more: one per
    sub-model); `disk_kinds`: per sub-model, the kinds of its states on disk (none: all on
    the host), which then take only the staging buffers they pass through."""
    kinds = list(disk_kinds) or [frozenset()] * len(subs)
    parts = [_submodel_host(s, states_by_kind(s, master_dtype, transfer_dtype, optimizer_states),
                            k) for s, k in zip(subs, kinds)]
    return _host_bytes(_Buffers.of(subs, master_dtype, transfer_dtype, optimizer_states,
                                   grad_slots), _Shares.of(parts), stash_bytes, sent_bytes)


@dataclass(frozen=True)
class _Buffers:
    """What no state's place changes: the gradient buffers, the chunked update's scratch and
    whether the update is chunked whatever goes to disk."""

    gradients: int
    scratch: int
    chunked: bool

    @classmethod
    def of(cls, subs: Sequence[SubmodelWeights], master_dtype: str, transfer_dtype: str,
           optimizer_states: str, grad_slots: int | None) -> _Buffers:
        mb, tb = DTYPE_BYTES[master_dtype], DTYPE_BYTES[transfer_dtype]
        ring = grad_slots is not None and grad_slots < len(subs)
        grads = arena_bytes([max((s.grad for s in subs), default=0) * tb] * grad_slots if ring
                            else [s.grad * tb for s in subs])
        return cls(grads + (sum(s.shared for s in subs) * mb if ring else 0),
                   UPDATE_SCRATCH_BUFFERS * update_scratch_numel([s.trainable for s in subs])
                   * mb, chunked_update(master_dtype, transfer_dtype, optimizer_states))


def _host_bytes(buffers: _Buffers, shares: _Shares, stash_bytes: int = 0,
                sent_bytes: int = 0) -> dict[str, int]:
    """host_bytes_by_kind from the buffers and the sub-models' shares."""
    scratch = buffers.scratch if buffers.chunked or shares.on_disk else 0
    staging = (STAGING_SLOTS * shares.staged + IMAGE_SLOTS * aligned(shares.disk_image)
               ) if shares.staged else 0
    return {
        "masters": shares.masters,
        "optimizer_states": shares.moments + scratch,
        "transfer_copies": shares.image_arena,
        "gradient_buffers": buffers.gradients,
        "activation_stash": stash_bytes,
        "activations_sent": sent_bytes,
        "disk_staging": staging,
    }


def place_on_disk(subs: Sequence[SubmodelWeights], master_dtype: str, transfer_dtype: str,
                  optimizer_states: str, limit_bytes: int, stash_bytes: int = 0,
                  sent_bytes: int = 0, grad_slots: int | None = None
                  ) -> list[frozenset[str]] | None:
    """Per sub-model, the kinds of its states to keep on disk so that the host bytes fit
    `limit_bytes`: none when they fit as they are; else the moments, then the masters beyond
    the images, then the images (DISK_KINDS), each of the largest sub-models first, until they
    fit (a sub-model holding replicas of tied weights keeps its image on the host: their
    owner's update refreshes them there). None when even that leaves them over the limit.
    The other arguments are host_bytes_by_kind's."""
    kinds: list[set[str]] = [set() for _ in subs]
    states = [states_by_kind(s, master_dtype, transfer_dtype, optimizer_states) for s in subs]
    # each step moves one kind of one sub-model: only its share is worked out again
    parts = [_submodel_host(s, st, k) for s, st, k in zip(subs, states, kinds)]
    shares = _Shares.of(parts)
    buffers = _Buffers.of(subs, master_dtype, transfer_dtype, optimizer_states,
                          grad_slots)

    def fits() -> bool:
        return sum(_host_bytes(buffers, shares, stash_bytes, sent_bytes).values()) <= limit_bytes

    if fits():
        return [frozenset()] * len(subs)
    for kind in DISK_KINDS:
        for i in sorted(range(len(subs)), key=lambda i: -states[i][kind]):
            if not states[i][kind] or (kind == "images" and subs[i].replicas):
                continue
            kinds[i].add(kind)
            old, parts[i] = parts[i], _submodel_host(subs[i], states[i], kinds[i])
            shares = shares.moved(old, parts[i], parts)
            if fits():
                return [frozenset(k) for k in kinds]
    return None


def disk_need_bytes(subs: Sequence[SubmodelWeights], master_dtype: str, transfer_dtype: str,
                    optimizer_states: str, kinds: Sequence[frozenset[str]]) -> tuple[int, int]:
    """(bytes of the records, what the drives must have free for them): every record, one
    more being written beside the current one, and a checkpoint's links holding a full set
    until the run's records move on."""
    records = [record_bytes(states_by_kind(s, master_dtype, transfer_dtype, optimizer_states), k)
               for s, k in zip(subs, kinds)]
    return sum(records), 2 * sum(records) + max(records, default=0)


@dataclass(frozen=True)
class HostBudget:
    """What the partitioner plans the host side for: the memory the run may take (0: not
    checked) and where that figure comes from, the moments' dtype, and whether the run clips
    its gradients' norm (it then holds every sub-model's gradients)."""

    limit_bytes: int = 0
    source: str = ""
    optimizer_states: str = "float32"
    clipping: bool = False
    disk: DiskSpec | None = None  # drives the states may go to when the host is short


def available_host_bytes() -> int | None:
    """This machine's available memory (MemAvailable, or psutil's figure); None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size if pages > 0 and size > 0 else None
    return int(psutil.virtual_memory().available)


def describe(by_kind: dict[str, int]) -> str:
    """'X: a fp32 masters + b optimizer moments + ...' (kinds with bytes only)."""
    total = sum(by_kind.values())
    parts = [f"{format_bytes(by_kind[k])} {KIND_WORDS[k]}" for k in KINDS if by_kind.get(k)]
    return f"{format_bytes(total)} ({' + '.join(parts) or 'nothing'})"


def remedies(optimizer_states: str, frozen: bool) -> str:
    """What makes a run's host memory smaller: options of atomc partition and atomc train."""
    out = []
    if optimizer_states == "float32":
        out.append("--optimizer-states bfloat16 (the moments in half the bytes)")
    if not frozen:
        out.append("freezing weights (adapters such as LoRA, a frozen backbone: a frozen "
                   "weight has no gradient buffer, moments or update)")
    out.append("--offload-dir PATH (model states on NVMe drives, one directory per drive) or "
               "more drives")
    out.append("a machine with more memory")
    return "; ".join(out)


def check_fits(by_kind: dict[str, int], limit: int, what: str, optimizer_states: str,
               frozen: bool) -> None:
    """UsageError in one line when the host bytes exceed `limit`."""
    if sum(by_kind.values()) > limit:
        raise UsageError(f"{what}: the run needs {describe(by_kind)} of host memory, more than "
                         f"the {format_bytes(limit)} there; try "
                         f"{remedies(optimizer_states, frozen)}")


def plan_weights(graph: OpGraph, submodels: Sequence[Submodel],
                 transfer_dtype: str) -> list[SubmodelWeights]:
    """The host store's layout sizes of a plan's sub-models, from the graph's parameters: a
    weight is owned by the first sub-model that reads it and replicated in later readers; a
    full-precision (norm) weight takes float32's span in a half-precision image."""
    frozen = set(graph.frozen or ())
    ratio = max(1, 4 // DTYPE_BYTES.get(transfer_dtype, 4))
    owner: dict[str, int] = {}
    replicated: set[str] = set()  # read again by a later sub-model than its owner
    sizes = []
    for s in submodels:
        seen: dict[str, None] = {}
        for node in graph.nodes[s.start:s.stop]:
            for fqn in node.param_fqns:
                seen.setdefault(graph.aliases.get(fqn, fqn))
        image = owned = trainable = grad = replicas = 0
        for fqn in seen:
            spec = graph.params.get(fqn)
            if spec is None:
                continue
            n = math.prod(spec.shape)
            span = n * ratio if fqn in graph.full_precision else n
            image += span
            if fqn not in frozen:
                grad += span
            if owner.setdefault(fqn, s.index) == s.index:
                owned += n
                trainable += 0 if fqn in frozen else n
            else:
                replicated.add(fqn)
                replicas += span
        sizes.append((image, owned, trainable, grad, replicas))
    shared = [0] * len(sizes)
    for fqn in replicated - frozen:
        shared[owner[fqn]] += math.prod(graph.params[fqn].shape)
    return [SubmodelWeights(*size[:4], shared=n, replicas=size[4])
            for size, n in zip(sizes, shared)]


def plan_stash_bytes(plan_submodels: Sequence[Submodel], accum: int, activations: str) -> int:
    """Boundary values the runtime stashes on the host (recompute, when the plan streams
    checkpoints): each value crossing a cut once per micro-batch."""
    if activations == "keep" or not any(s.checkpoint_ms > 0 for s in plan_submodels[:-1]):
        return 0
    values = {t.name: t.num_bytes for s in plan_submodels[:-1] for t in s.crossing}
    return accum * sum(values.values())


def plan_sent_bytes(plan_submodels: Sequence[Submodel], accum: int) -> int:
    """Heavy operators' outputs the runtime sends to the host (activations="auto"), C
    micro-batches of every sub-model: all held at the turn from forward to backward."""
    return accum * sum(s.sent_bytes for s in plan_submodels)


def plan_grad_slots(plan: Plan, every_gradient: bool = False) -> int | None:
    """The host gradient buffers `plan`'s run takes in turn: one more than the most sub-models
    whose gradients its simulated steps hold at once (from the copy that brings them back to
    the update that consumes them), so that a slower update than planned still leaves one;
    None (one per sub-model) where that is all of them, and where the run clips or scales its
    loss (`every_gradient`: no update before every gradient is in)."""
    from atomc.simulate import gradients_in_flight, simulate_plan

    if every_gradient:
        return None
    # at least one arriving while another is consumed
    slots = max(2, gradients_in_flight(simulate_plan(plan, num_steps=2).timeline) + 1)
    return slots if slots < len(plan.submodels) else None


def loss_scaled(plan: Plan) -> bool:
    """Whether a run of `plan` scales its loss by default (a float16 transfer or compute
    dtype: atomc.runtime's loss_scale default), which holds every gradient like clipping."""
    return "float16" in (plan.transfer_dtype, plan.autocast)


def plan_host_memory(plan: Plan, graph: OpGraph, optimizer_states: str = "float32",
                     limit_bytes: int = 0, limit_source: str = "",
                     clipping: bool = False, disk: DiskSpec | None = None) -> HostMemory:
    """The host bytes of `plan`'s run by kind (the runtime's formula) and its limit;
    `clipping`: the run clips its gradients' global norm (every gradient is held). Where
    they exceed the limit and `disk` gives drives, the states that go there (place_on_disk),
    their bytes and the free space they need; over the limit still where nothing fits."""
    moment_bytes(optimizer_states)  # a bad name fails here, in one line
    master = "float64" if graph.dtype == "float64" else "float32"
    transfer = plan.transfer_dtype or (graph.dtype if graph.dtype in DTYPE_BYTES else master)
    subs = plan_weights(graph, plan.submodels, transfer)
    slots = plan_grad_slots(plan, clipping or loss_scaled(plan))
    others = {"stash_bytes": plan_stash_bytes(plan.submodels, plan.accum, plan.activations),
              "sent_bytes": plan_sent_bytes(plan.submodels, plan.accum), "grad_slots": slots}
    kinds: list[frozenset[str]] = [frozenset()] * len(subs)
    if disk is not None and limit_bytes:
        kinds = place_on_disk(subs, master, transfer, optimizer_states, limit_bytes,
                              **others) or [frozenset(DISK_KINDS) - (
                                  {"images"} if s.replicas else set()) for s in subs]
    by_kind = host_bytes_by_kind(subs, master, transfer, optimizer_states, disk_kinds=kinds,
                                 **others)
    on_disk = any(kinds)
    records, need = (disk_need_bytes(subs, master, transfer, optimizer_states, kinds)
                     if on_disk else (0, 0))
    disk_by_kind: dict[str, int] = {}
    for s, k in zip(subs, kinds):
        for kind, n in states_by_kind(s, master, transfer, optimizer_states).items():
            if kind in k and n:
                disk_by_kind[kind] = disk_by_kind.get(kind, 0) + n
    trainable = sum(s.trainable for s in subs)
    return HostMemory(by_kind=by_kind, optimizer_states=optimizer_states,
                      trainable_params=trainable,
                      frozen_params=sum(s.owned for s in subs) - trainable,
                      limit_bytes=limit_bytes, limit_source=limit_source,
                      grad_slots=slots or 0, disk=disk if on_disk else None,
                      disk_kinds=tuple(tuple(sorted(k)) for k in kinds) if on_disk else (),
                      disk_by_kind=disk_by_kind, disk_need_bytes=need if records else 0)


def disk_times(plan: Plan, graph: OpGraph, host: HostMemory) -> Plan:
    """`plan` with each sub-model's disk traffic timed (its record read before its update and
    written after it, its image read before each load) at the drives' rates, striped over
    them; unchanged where nothing is on disk."""
    if host.disk is None or not host.disk_kinds:
        return plan
    import dataclasses

    master = "float64" if graph.dtype == "float64" else "float32"
    transfer = plan.transfer_dtype or (graph.dtype if graph.dtype in DTYPE_BYTES else master)
    read = host.disk.drives * host.disk.read_gbps * 1e6  # bytes per ms
    write = host.disk.drives * host.disk.write_gbps * 1e6
    subs = []
    for sub, weights, kinds in zip(plan.submodels, plan_weights(graph, plan.submodels, transfer),
                                   host.disk_kinds):
        states = states_by_kind(weights, master, transfer, host.optimizer_states)
        record = record_bytes(states, frozenset(kinds))
        image = aligned(states["images"]) if "images" in kinds else 0
        subs.append(dataclasses.replace(sub, disk_read_ms=record / read,
                                        disk_write_ms=record / write,
                                        image_read_ms=image / read))
    return dataclasses.replace(plan, submodels=tuple(subs))


def resolve_host_mem(value: str | None, profile: Profile) -> tuple[int, str]:
    """`--host-mem` -> (bytes, where from); (0, why) when there is nothing to check against.

    Without it: this machine's available memory for a measured profile; for an estimated one
    (`--target`), the host memory its hardware profile states (`host_memory_bytes`, sourced
    in its `sources`), else nothing: the plan then says it was not checked, and how to."""
    if value is not None:
        return parse_size(value, "--host-mem"), "--host-mem"
    if profile.mode == "estimated":
        hw = profile.hardware
        if hw is not None and hw.host_memory_bytes:
            return hw.host_memory_bytes, (f"the host hardware profile {hw.name} states; "
                                          f"--host-mem SIZE checks the machine it will train on")
        what = (f"hardware profile {hw.name} states no host memory" if hw is not None
                else f"the profile is estimated for {profile.device} with no hardware profile")
        return 0, (f"not checked: {what}, and the host is not here; give --host-mem SIZE "
                   f"(the RAM of the machine it will train on)")
    avail = available_host_bytes()
    if avail is None:
        return 0, "not checked: this machine's available memory is unknown; give --host-mem"
    return avail, f"available on {socket.gethostname()} now (MemAvailable)"


def check_plan_host(host: HostMemory, frozen: bool) -> None:
    """UsageError in one line when the plan's host bytes exceed its limit."""
    if host.limit_bytes:
        check_fits(host.by_kind, host.limit_bytes, f"host memory ({host.limit_source})",
                   host.optimizer_states, frozen)
