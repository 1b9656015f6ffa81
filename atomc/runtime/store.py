"""Runtime stage, host store: every sub-model's weights, gradients and optimizer moments in flat
host buffers, or (the states the plan puts there) in files on NVMe drives.

Input: the generated package's PARAM_NAMES/TIED, one built copy of the sub-models, and the
plan's host settings (gradient slots, the kinds of states on disk). Output: a `HostStore`
with, per sub-model i,

- `image[i]`: the flat buffer the device loads in ONE copy (transfer dtype; pinned on CUDA).
  Its layout is [owned decayed params | owned undecayed params | replicas], where a replica
  is a tied parameter whose master lives in an earlier sub-model.
- the masters, the owned weights in the master dtype, kept one of three ways (`store_mode`):
  "direct" (the image is the master: same dtype), "split" (float32 masters, bfloat16 image:
  the image is each master's high half and `residual[i]`, int16, its low half, so masters
  cost 4 bytes with their images; `split_master`/`join_master`), "separate" (a buffer of
  their own, cast into the image after each update). `read_master`, `widen_master` and
  `narrow_master` read and write them whichever way they are kept.
- `moments[i]`: AdamW's two moments of the owned trainable weights, flat in master order
  (the master dtype, or bfloat16).
- gradients: the flat buffer the device's gradients come back into in ONE copy (pinned), from
  `grads` (GradBuffers): one per sub-model, or a ring of the sub-models in flight where no
  clipping or loss scaling waits for every gradient (`acquire`/`release`). Trainable weights
  only: a frozen weight (a LoRA model's base) has no gradient buffer, no optimizer state and
  is never updated or re-cast.
- states on disk (`disk_kinds[i]`: moments, masters beyond the image, the image): one record
  per sub-model in `tier` (atomc.runtime.tier), streamed a segment at a time through staging
  buffers; while a segment is staged, the views above are views of it (`rewrite`, `visit`),
  and an image on disk is loaded from the tier's pinned ring (`load_source`).

A tied parameter has one master and one optimizer state (in its first holder, the lowest
sub-model index); each holder's image carries a replica refreshed from that master after
every update, so every holder is loaded with the same weights. With a gradient ring, the
holders' gradients are summed into `tied_sums` as they give their buffers back.

Pinned memory: each kind's buffers are views into ONE allocation (a `HostArena`), page-locked
where it lies (cudaHostRegister): one registration per kind, and none of the power-of-two
rounding PyTorch's pinned allocator (pin_memory=True) puts on every allocation, up to twice
the bytes. The arenas are allocated once and reused every step. The residuals and moments are
not pinned (the device never reads them).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atomc.errors import RuntimeMismatchError
from atomc.partition import hostmem
from atomc.partition.hostmem import (
    ARENA_ALIGN,
    MOMENTS_PER_WEIGHT,
    SubmodelWeights,
    host_bytes_by_kind,
)
from atomc.runtime.disk import DriveCheck, StateFiles
from atomc.runtime.package import SwapPackage
from atomc.runtime.tier import (
    DiskTier,
    Window,
    record_regions,
    record_size,
    segments,
    update_chunks,
)

DecayFilter = Callable[[str, tuple[int, ...]], bool]


WIDE_DTYPE = torch.float32  # what a full-precision weight is on the device in a half-precision run


@dataclass(frozen=True)
class ParamEntry:
    local: str  # the sub-model's own parameter name
    key: str  # the original FQN naming the master (the tie group for tied weights)
    shape: tuple[int, ...]
    numel: int
    offset: int  # in this sub-model's image, in image elements
    owner: int  # sub-model whose master holds it
    owner_offset: int  # in the owner's master, in master elements
    decay: bool
    owned: bool  # this entry is the master (else a replica of the owner's)
    span: int = 0  # image elements it takes: numel, or more for a wide entry
    wide: bool = False  # kept in WIDE_DTYPE (float32) in a half-precision image
    trainable: bool = True  # False: frozen in the model (requires_grad=False), never updated
    grad_offset: int = -1  # in this sub-model's gradient buffer; -1: frozen, it has no gradient

    def image_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This entry's tensor inside a flat image buffer of the transfer dtype."""
        return self._view(flat, self.offset)

    def grad_view(self, flat: torch.Tensor) -> torch.Tensor:
        """This entry's gradient inside a flat gradient buffer (a trainable entry only)."""
        assert self.grad_offset >= 0, f"{self.key} is frozen: it has no gradient"
        return self._view(flat, self.grad_offset)

    def _view(self, flat: torch.Tensor, start: int) -> torch.Tensor:
        part = flat[start:start + (self.span or self.numel)]
        return (part.view(WIDE_DTYPE) if self.wide else part).view(self.shape)


@dataclass(frozen=True)
class SubLayout:
    index: int
    entries: tuple[ParamEntry, ...]  # image order
    numel: int  # image elements
    owned_numel: int  # master elements (with no wide entries also [0, owned_numel) of the image)
    # master elements [0, decay_numel) are trainable and decayed, [decay_numel,
    # trainable_numel) trainable and not decayed, [trainable_numel, owned_numel) frozen
    decay_numel: int
    trainable_numel: int
    grad_numel: int  # gradient buffer elements: the trainable entries only
    shared_numel: int = 0  # owned trainable elements that later sub-models hold replicas of

    def weights(self) -> SubmodelWeights:
        """Its sizes as the host-memory formula (atomc.partition.hostmem) takes them."""
        return SubmodelWeights(self.numel, self.owned_numel, self.trainable_numel,
                               self.grad_numel, self.shared_numel)

    def signature(self) -> list[tuple[str, list[int], int, bool]]:
        return [(e.key, list(e.shape), e.owner, e.decay) for e in self.entries]

    def runs(self, trainable_only: bool = False) -> list[tuple[int, int, int, int, bool]]:
        """(image offset, image span, master offset, numel, wide) of the owned entries (the
        trainable ones only: also their places in the gradient buffer), with neighbours of one
        kind merged: what one copy between master and image moves."""
        out: list[list] = []
        for e in self.entries:
            if not e.owned or (trainable_only and not e.trainable):
                continue
            last = out[-1] if out else None
            if (last is not None and last[4] == e.wide and last[0] + last[1] == e.offset
                    and last[2] + last[3] == e.owner_offset):
                last[1] += e.span or e.numel
                last[3] += e.numel
            else:
                out.append([e.offset, e.span or e.numel, e.owner_offset, e.numel, e.wide])
        return [tuple(r) for r in out]  # type: ignore[misc]


def trainable_places(L: SubLayout) -> list[slice]:
    """Where each owned trainable weight of a layout is in its master, in master order (the
    update's weights: decayed, then not)."""
    places = [slice(e.owner_offset, e.owner_offset + e.numel) for e in L.entries
              if e.owned and e.trainable]
    return sorted(places, key=lambda w: w.start)


def plan_layouts(package: SwapPackage, modules: list[nn.Module],
                 decay_filter: DecayFilter | None = None, *,
                 transfer_dtype: torch.dtype | None = None) -> list[SubLayout]:
    """Place every parameter of every sub-model in its image; tied ones once as master.

    With a half-precision `transfer_dtype`, the package's FULL_PRECISION weights (those of
    normalisation layers) are wide entries: float32 inside the half-precision image, as FSDP's
    MixedPrecision keeps BatchNorm in full precision. A wide entry takes two image elements per
    weight and starts at an even element, so the image is still one buffer and one copy.

    A frozen weight (requires_grad=False in the model: a LoRA model's base weights) is placed
    after the trainable ones, owned and replicas alike, so that the gradient buffer holds the
    trainable entries only: the owned ones at their image offsets, then the replicas. A frozen
    weight has no gradient buffer, no gradient copy, no optimizer state and no update.
    """
    half = transfer_dtype is not None and transfer_dtype.itemsize < WIDE_DTYPE.itemsize
    ratio = WIDE_DTYPE.itemsize // transfer_dtype.itemsize if half else 1
    wide_keys = set(package.full_precision) if half else set()
    tie_key = {(i, local): key for key, holders in package.tied.items() for i, local in holders}
    shapes: list[dict[str, tuple[int, ...]]] = []
    trains: list[dict[str, bool]] = []  # requires_grad: False for a weight the model freezes
    param_names: list[dict[str, str]] = []  # PARAM_NAMES without the buffers it also maps
    for i, mod in enumerate(modules):
        named = {n: tuple(p.shape) for n, p in mod.named_parameters()}
        trains.append({n: p.requires_grad for n, p in mod.named_parameters()})
        buffers = {n for n, _ in mod.named_buffers()}
        listed = package.param_names[i]
        lacking = sorted(set(named) - set(listed))
        unknown = sorted(set(listed) - set(named) - buffers)
        if lacking or unknown:
            raise RuntimeMismatchError(
                f"sub-model {i} of {package.path} has parameters {lacking} that PARAM_NAMES does "
                f"not map, and PARAM_NAMES names {unknown}, which it does not have; the package "
                f"is damaged, regenerate it")
        shapes.append(named)
        param_names.append({local: fqn for local, fqn in listed.items() if local in named})

    owner_of: dict[str, int] = {}
    for i, names in enumerate(param_names):
        for local in names:
            key = tie_key.get((i, local), names[local])
            owner_of.setdefault(key, i)

    layouts: list[SubLayout] = []
    owner_offsets: dict[str, int] = {}
    trainable_of: dict[str, bool] = {}  # a tied weight's holders follow its owner
    for i, names in enumerate(param_names):
        owned_decay, owned_plain, owned_frozen, replicas = [], [], [], []
        seen_here: set[str] = set()
        for local, fqn in names.items():
            key = tie_key.get((i, local), fqn)
            shape = shapes[i][local]
            decay = True if decay_filter is None else bool(decay_filter(key, shape))
            if owner_of[key] == i and key not in seen_here:
                group = (owned_frozen if not trains[i][local]
                         else owned_decay if decay else owned_plain)
                group.append((local, key, shape, decay))
                trainable_of[key] = trains[i][local]
                seen_here.add(key)
            else:
                replicas.append((local, key, shape, decay))
        entries: list[ParamEntry] = []
        offset = master_offset = 0

        def place(key: str, n: int) -> tuple[int, int, bool]:
            nonlocal offset
            wide = key in wide_keys
            if wide:
                offset = -(-offset // ratio) * ratio  # a whole WIDE_DTYPE element
            start, span = offset, n * ratio if wide else n
            offset += span
            return start, span, wide

        grad_end = 0
        for local, key, shape, decay in owned_decay + owned_plain + owned_frozen:
            n = math.prod(shape)
            owner_offsets[key] = master_offset
            start, span, wide = place(key, n)
            trainable = trainable_of[key]
            entries.append(ParamEntry(local, key, shape, n, start, i, master_offset, decay, True,
                                      span, wide, trainable, start if trainable else -1))
            grad_end = offset if trainable else grad_end
            master_offset += n
        owned = master_offset
        decay_numel = sum(math.prod(s) for _, _, s, _ in owned_decay)
        trainable_numel = decay_numel + sum(math.prod(s) for _, _, s, _ in owned_plain)
        replicas.sort(key=lambda r: not trainable_of[r[1]])  # trainable first, order kept
        for local, key, shape, decay in replicas:
            n = math.prod(shape)
            o = owner_of[key]
            if o == i:
                o_off = owner_offsets[key]
            elif o < i:
                o_off = next(e.owner_offset for e in layouts[o].entries if e.key == key and e.owned)
            else:  # pragma: no cover - owner_of takes the first holder
                raise AssertionError("a tie's owner comes after its holder")
            owner_shape = _entry_shape(layouts, entries, o, key)
            if owner_shape != shape:
                raise RuntimeMismatchError(
                    f"tied parameter {key} has shape {list(owner_shape)} in sub-model {o} but "
                    f"{list(shape)} in sub-model {i} ({local}); the package is damaged, "
                    f"regenerate it")
            start, span, wide = place(key, n)
            trainable, g_start = trainable_of[key], -1
            if trainable:
                if wide:
                    grad_end = -(-grad_end // ratio) * ratio
                g_start, grad_end = grad_end, grad_end + span
            entries.append(ParamEntry(local, key, shape, n, start, o, o_off, decay, False,
                                      span, wide, trainable, g_start))
        layouts.append(SubLayout(i, tuple(entries), offset, owned, decay_numel, trainable_numel,
                                 grad_end))
    replicated = {e.key for L in layouts for e in L.entries if not e.owned and e.trainable}
    return [dataclasses.replace(L, shared_numel=sum(e.numel for e in L.entries if e.owned
                                                    and e.key in replicated))
            for L in layouts]


def _entry_shape(layouts: list[SubLayout], current: list[ParamEntry], owner: int,
                 key: str) -> tuple[int, ...]:
    pool = current if owner == len(layouts) else layouts[owner].entries
    return next(e.shape for e in pool if e.key == key and e.owned)


class HostArena:
    """Host buffers that are views into ONE allocation, pinned when `pin` (ordinary memory if not).

    `specs` lists (shape, dtype) per buffer, or (shape, dtype, strides) for a dense buffer laid
    out in another order than row-major; `buffers[j]` is buffer j, starting at a multiple of
    ARENA_ALIGN bytes of the allocation. One allocation pays the pinned allocator's
    power-of-two rounding once, where one per buffer would pay it for each (see the module
    docstring). The CPU path (`pin=False`) runs the same code with ordinary memory.
    """

    def __init__(self, specs: Sequence[tuple[Any, ...]], pin: bool):
        self.pin = pin
        laid = [(tuple(s[0]), s[1], tuple(s[2]) if len(s) > 2 else None) for s in specs]
        offsets, end = [], 0
        for shape, dtype, _ in laid:
            start = -(-end // ARENA_ALIGN) * ARENA_ALIGN
            offsets.append(start)
            end = start + math.prod(shape) * dtype.itemsize
        self.nbytes = end  # what the buffers span, alignment gaps included
        self.storage = torch.zeros(end, dtype=torch.uint8)
        if pin and end:
            register_pinned(self.storage)
        self.buffers: list[torch.Tensor] = []
        for (shape, dtype, strides), start in zip(laid, offsets):
            flat = self.storage[start:start + math.prod(shape) * dtype.itemsize].view(dtype)
            self.buffers.append(flat.view(shape) if strides is None
                                else flat.as_strided(shape, strides))

    def pinned_bytes(self) -> int:
        """Pinned host bytes this arena holds (0 when not pinned)."""
        return self.nbytes if self.pin else 0


def register_pinned(t: torch.Tensor) -> None:
    """Page-lock `t`'s memory for the GPU's copy engines where it lies (cudaHostRegister),
    for as long as `t`'s storage lives. PyTorch's pinned allocator (pin_memory=True) would
    round the allocation up to a power of two: an arena of 15 GiB would take 16, one of
    8.1 GiB 16. Refused in one line when CUDA cannot lock it (the limit on locked memory,
    `ulimit -l`)."""
    import weakref

    cudart = torch.cuda.cudart()
    ptr, size = t.data_ptr(), t.untyped_storage().nbytes()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        from atomc.errors import RuntimeMismatchError
        from atomc.units import format_bytes

        raise RuntimeMismatchError(
            f"cannot page-lock {format_bytes(size)} of host memory for the GPU's copies (CUDA "
            f"error {int(err)}): raise the locked-memory limit (ulimit -l unlimited) or free "
            f"host memory")
    weakref.finalize(t.untyped_storage(), cudart.cudaHostUnregister, ptr)


class HostBuffers:
    """Host buffers by key for values whose shapes only a step shows (the activation stash's
    boundary values, the operator outputs sent to the host), reused every step.

    The first step (or one whose shapes changed) makes them in ordinary memory, which is
    correct on CUDA too (a device-to-host copy into pageable memory returns when it is done;
    the copy back is staged before it returns), only slower; at the end of that step
    `end_step` puts every buffer into one `HostArena`, pinned on CUDA, so the pinned
    allocator's power-of-two rounding is paid once and not per buffer. Pinned blocks made per
    buffer and freed would stay in PyTorch's pinned cache, which is why the first step does
    not pin."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.host: dict[Any, torch.Tensor] = {}
        self.arena: HostArena | None = None
        self.unplaced = False  # a buffer outside the arena was made this step

    def buffer(self, key: Any, like: torch.Tensor) -> torch.Tensor:
        """The buffer of `key` shaped like `like`, in `like`'s memory order: dropout and the
        other random operators draw in memory order, so a recomputation from a row-major copy
        of a transposed value drew other masks than its forward."""
        buf = self.host.get(key)
        layout = torch.empty_like(like, device="meta").stride()
        if (buf is None or buf.shape != like.shape or buf.dtype != like.dtype
                or buf.stride() != layout):
            buf = torch.empty_like(like, device="cpu")
            self.host[key] = buf
            self.unplaced = True
        return buf

    def end_step(self) -> None:
        """After a step that made new buffers: move every buffer into one new arena."""
        if not self.unplaced:
            return
        keys = list(self.host)
        self.arena = HostArena([(tuple(self.host[k].shape), self.host[k].dtype,
                                 self.host[k].stride()) for k in keys], pin=self.pin)
        # the old buffers may still be read by queued copies: pageable ones were staged when the
        # copy was issued; an old arena's pinned block is kept by the allocator until they end
        self.host = dict(zip(keys, self.arena.buffers))
        self.unplaced = False

    def pinned_bytes(self) -> int:
        """Pinned host memory of the arena (0 before the first step that made buffers)."""
        return self.arena.pinned_bytes() if self.arena is not None else 0


def split_master(master: torch.Tensor, image: torch.Tensor, residual: torch.Tensor) -> None:
    """float32 `master` -> its bfloat16 `image` (int16 bits: round to nearest, ties away from
    zero) and the int16 `residual` that makes it whole again (`join_master`).

    A float32's bits are its bfloat16 truncation (high half) and 16 more bits (low half). The
    image is the high half plus one where the low half is 0x8000 or more: rounding to nearest,
    which differs from `.to(torch.bfloat16)` only at exact ties (ties to even there). The
    residual is the low half read as a signed int16, which is negative exactly where one was
    added: high = image - (residual < 0), and the float32 is exact again. The image is thus
    the half of the master the GPU loads, and no separate float32 copy is kept.
    """
    halves = master.view(torch.int16).view(-1, 2)  # little-endian: [low, high] per float32
    residual.copy_(halves[:, 0])
    image.copy_(halves[:, 1])
    image.add_(residual.lt(0).view(torch.int8))


def join_master(image: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> None:
    """The float32 masters of `image` (int16 bits of bfloat16) and `residual` into `out`."""
    halves = out.view(torch.int16).view(-1, 2)
    halves[:, 0].copy_(residual)
    torch.sub(image, residual.lt(0).view(torch.int8), out=halves[:, 1])


def moment_dtype(states: str, master_dtype: torch.dtype) -> torch.dtype:
    """The dtype AdamW's moments are kept in: the masters' ("float32" names the default, full
    precision: a float64 run's moments are float64), or bfloat16."""
    return master_dtype if states == "float32" else getattr(torch, states)


def store_mode(master_dtype: torch.dtype, transfer_dtype: torch.dtype) -> str:
    """How a store keeps the masters beside the images the GPU loads: "direct" (the same
    dtype: the image is the master), "split" (float32 masters, bfloat16 images: the image is
    the master's high half, a residual its low half; see split_master), "separate" (any other
    pair, float16 images: a master of its own, cast into the image after each update)."""
    if master_dtype == transfer_dtype:
        return "direct"
    if master_dtype == torch.float32 and transfer_dtype == torch.bfloat16:
        return "split"
    return "separate"


class GradBuffers:
    """The pinned host buffers the device's gradients come back into, in one arena.

    Whole (`slots=None`): one buffer per sub-model, held from its gradients' arrival to its
    update; what clipping and loss scaling need (no update before every gradient is in, for
    the global norm). A ring (`slots=R`): R buffers of the largest sub-model's size, each
    taken by a sub-model when its gradients come back and given back when its update has
    consumed them, so that only the sub-models in flight hold one.
    """

    def __init__(self, layouts: Sequence[SubLayout], dtype: torch.dtype, pin: bool,
                 slots: int | None):
        self.sizes = [L.grad_numel for L in layouts]
        self.ring = slots is not None and slots < len(layouts)
        count = slots if self.ring else len(layouts)
        shapes = [(max(self.sizes),)] * count if self.ring else [(n,) for n in self.sizes]
        self.arena = HostArena([(shape, dtype) for shape in shapes], pin)
        self.holder: list[int | None] = list(range(count)) if not self.ring else [None] * count
        self.slot_of: dict[int, int] = {} if self.ring else {i: i for i in range(len(layouts))}
        self._order: list[int] = []  # ring: holders in the order they took their slots
        self._lock = threading.Condition()

    @property
    def num_slots(self) -> int:
        return len(self.arena.buffers)

    def acquire(self, i: int, wait_for: Callable[[int], None]) -> torch.Tensor:
        """The buffer sub-model i's gradients come back into. In a ring, a free slot; when
        none is, `wait_for(h)` waits for the update of the sub-model h that has held one
        longest, which gives it back."""
        if not self.ring:
            return self.tensor(i)
        while True:
            with self._lock:
                if i in self.slot_of:
                    return self.tensor(i)
                free = next((s for s, h in enumerate(self.holder) if h is None), None)
                if free is not None:
                    self.holder[free] = i
                    self.slot_of[i] = free
                    self._order.append(i)
                    return self.tensor(i)
                oldest = self._order[0]
            wait_for(oldest)
            with self._lock:
                if oldest in self.slot_of:  # its update did not give it back: a failure
                    raise RuntimeError(f"sub-model {oldest}'s update ended without giving back "
                                       f"its gradient buffer")

    def tensor(self, i: int) -> torch.Tensor:
        return self.arena.buffers[self.slot_of[i]][:self.sizes[i]]

    def release(self, i: int) -> None:
        """Sub-model i's update has consumed its gradients (a ring slot goes back)."""
        if not self.ring:
            return
        with self._lock:
            slot = self.slot_of.pop(i, None)
            if slot is not None:
                self.holder[slot] = None
                self._order.remove(i)
                self._lock.notify_all()

    def pinned_bytes(self) -> int:
        return self.arena.pinned_bytes()


class HostStore:
    """The flat host buffers of all sub-models (see the module docstring)."""

    def __init__(self, layouts: list[SubLayout], master_dtype: torch.dtype,
                 transfer_dtype: torch.dtype, pin: bool, *, moment_dtype: torch.dtype | None = None,
                 grad_slots: int | None = None, disk_kinds: Sequence[frozenset[str]] = (),
                 drives: Sequence[DriveCheck] = ()):
        self.layouts = layouts
        self.master_dtype = master_dtype
        self.transfer_dtype = transfer_dtype
        self.moment_dtype = moment_dtype or master_dtype
        self.pin = pin
        self.mode = store_mode(master_dtype, transfer_dtype)
        k = len(layouts)
        kinds = list(disk_kinds) or [frozenset()] * k
        self.drives = tuple(drives)  # the offload drives (DriveCheck), for other states beside
        if any(kinds) and not drives:
            raise ValueError("states on disk need the offload drives (atomc.runtime.disk)")
        self.disk_kinds = kinds
        # one flat buffer per sub-model whose image is on the host (one copy each), all in one
        # pinned arena; the others pass through the disk tier's pinned ring
        on_host = [i for i in range(k) if "images" not in kinds[i]]
        self.image_arena = HostArena([((layouts[i].numel,), transfer_dtype) for i in on_host],
                                     pin)
        self.image: list[torch.Tensor | None] = [None] * k
        for i, buf in zip(on_host, self.image_arena.buffers):
            self.image[i] = buf
        # the masters: views of the images ("direct"), buffers of their own ("separate"), or
        # the images' high halves and these low halves ("split"); AdamW's two moments per
        # trainable owned weight, flat in master order. Those on disk: None but while the
        # disk tier has them open
        self._masters: list[torch.Tensor | None] = [None] * k
        self.residual: list[torch.Tensor | None] = [None] * k
        self.moments: list[tuple[torch.Tensor, ...] | None] = [None] * k
        for i, L in enumerate(layouts):
            self._bind_views(i)
            if "masters" not in kinds[i] and self.mode == "separate":
                self._masters[i] = torch.zeros(L.owned_numel, dtype=master_dtype)
            elif "masters" not in kinds[i] and self.mode == "split":
                self.residual[i] = torch.zeros(L.owned_numel, dtype=torch.int16)
            if "moments" not in kinds[i]:
                self.moments[i] = tuple(torch.zeros(L.trainable_numel, dtype=self.moment_dtype)
                                        for _ in range(MOMENTS_PER_WEIGHT))
        self.grads = GradBuffers(layouts, transfer_dtype, pin, grad_slots)
        self._owned = [{e.key: e for e in L.entries if e.owned} for L in layouts]
        # owner -> [(holder, entry)] for every replica
        self.replicas_of: list[list[tuple[int, ParamEntry]]] = [[] for _ in layouts]
        for L in layouts:
            for e in L.entries:
                if not e.owned:
                    self.replicas_of[e.owner].append((L.index, e))
        # a ring gives a holder's buffer back before its owner's update: the replicas'
        # gradients are summed into the owner's tied weights here first (one per tied weight)
        self.tied_sums: dict[str, torch.Tensor] = {}
        if self.grads.ring:
            for holders in self.replicas_of:
                for _, e in holders:
                    if e.trainable and e.key not in self.tied_sums:
                        self.tied_sums[e.key] = torch.zeros(e.numel, dtype=master_dtype)
        self.runs = [L.runs() for L in layouts]
        self.trained_runs = [L.runs(trainable_only=True) for L in layouts]
        self._wide_ratio = max(1, WIDE_DTYPE.itemsize // transfer_dtype.itemsize)
        # the staged window of each sub-model's disk states: region -> its first element
        self._bases: list[dict[str, int]] = [{} for _ in layouts]
        self.tier: DiskTier | None = None
        if any(kinds):
            regions = [record_regions(kinds[i], (L.numel, transfer_dtype), self._beyond(L),
                                      (L.trainable_numel, self.moment_dtype))
                       for i, L in enumerate(layouts)]
            segs = [segments(regions[i], [c[0][0] for c in update_chunks(
                        trainable_places(L), hostmem.UPDATE_CHUNK)], L.owned_numel,
                        L.trainable_numel,
                        lambda a, i=i: self.image_at(i, a)) if regions[i] else []
                    for i, L in enumerate(layouts)]
            files = StateFiles(drives, [record_size(r) for r in regions])
            self.tier = DiskTier(files, regions, segs, self._bind_window,
                                 register_pinned if pin else None)
        # ties the executor sums on the device (tied_grads="exact")
        self.exact_keys: set[str] = set()
        # sub-models whose updates change what sub-model i loads
        self.load_deps: list[tuple[int, ...]] = [
            tuple(sorted({L.index} | {e.owner for e in L.entries})) for L in layouts]

    # ---- the disk tier -------------------------------------------------------------------------

    def _beyond(self, L: SubLayout) -> tuple[str, int, torch.dtype] | None:
        """What a sub-model's masters take beyond its image: (region, elements, dtype)."""
        if self.mode == "split":
            return ("residual", L.owned_numel, torch.int16)
        if self.mode == "separate":
            return ("master", L.owned_numel, self.master_dtype)
        return None

    def _bind_views(self, i: int) -> None:
        """A direct store's masters of sub-model i are views of its image."""
        if self.mode == "direct" and self.image[i] is not None:
            self._masters[i] = self.image[i][:self.layouts[i].owned_numel]

    def _bind_window(self, i: int, window: Window | None) -> None:
        """The store's views of sub-model i's disk states: a staged window's (based at its
        first elements), or (None) none."""
        kinds = self.disk_kinds[i]
        views = window.views if window is not None else {}
        self._bases[i] = dict(window.bases) if window is not None else {}
        if "images" in kinds:
            self.image[i] = views.get("image")
            if self.mode == "direct":
                self._masters[i] = self.image[i]
                if window is not None:
                    self._bases[i]["master"] = self._bases[i]["image"]
        if "masters" in kinds:
            if self.mode == "split":
                self.residual[i] = views.get("residual")
            elif self.mode == "separate":
                self._masters[i] = views.get("master")
        if "moments" in kinds:
            self.moments[i] = ((views["exp_avg"], views["exp_avg_sq"]) if window is not None
                               else None)

    def on_disk(self, i: int) -> bool:
        """Whether some of sub-model i's states live on disk."""
        return bool(self.disk_kinds[i])

    def prefetch(self, i: int) -> None:
        """Start reading sub-model i's states from disk, where a staging slot is free now."""
        if self.tier is not None and 0 <= i < len(self.layouts):
            self.tier.prefetch(i)

    def rewrite(self, i: int, change: Callable[[int, int], None]) -> None:
        """`change(a, b)` on sub-model i's masters [a, b) (and their moments): where its
        states are on disk, a segment at a time, each staged in the store and written back
        (atomc.runtime.tier); at once on the host."""
        if self.tier is None or not self.on_disk(i):
            change(0, self.layouts[i].owned_numel)
            return
        self.tier.rewrite(i, lambda w: change(w.segment.start, w.segment.stop))

    def visit(self, i: int, a: int, b: int, see: Callable[[int, int], None]) -> None:
        """`see(lo, hi)` over sub-model i's masters [a, b), staged a segment at a time where
        they are on disk (read only)."""
        if self.tier is None or not self.on_disk(i):
            see(a, b)
            return
        self.tier.visit(i, a, b, lambda w: see(max(a, w.segment.start),
                                               min(b, w.segment.stop)))

    def load_source(self, i: int, ahead: Sequence[int], ready: Callable[[int], bool]
                    ) -> torch.Tensor:
        """The host buffer sub-model i's image loads from: its own, or the disk tier's ring
        slot it was read into (reading ahead `ahead`, those `ready` says are final)."""
        if "images" not in self.disk_kinds[i]:
            return self.image[i]
        assert self.tier is not None
        return self.tier.image(i, [j for j in ahead if 0 <= j < len(self.layouts)], ready)

    def load_issued(self, i: int, event: Any) -> None:
        """The copy out of sub-model i's load source was issued (`event`, CUDA: when it is
        done; None: it is)."""
        if self.tier is not None and "images" in self.disk_kinds[i]:
            self.tier.released(i, event)

    def close(self) -> None:
        """Finish writing states to disk and remove the run's files."""
        if self.tier is not None:
            self.tier.files.close()

    # ---- masters -------------------------------------------------------------------------------

    def read_master(self, i: int) -> torch.Tensor:
        """Sub-model i's owned masters, flat in master order (read only: a view where the
        store keeps them whole on the host, a new tensor where it splits them or they are on
        disk)."""
        n = self.layouts[i].owned_numel
        if self.mode != "split" and not self.on_disk(i):
            return self._masters[i]
        out = torch.empty(n, dtype=self.master_dtype)
        self.visit(i, 0, n, lambda a, b: self.widen_master(i, a, b - a, out[a:b]))
        return out

    def read_entry(self, i: int, entry: ParamEntry) -> torch.Tensor:
        """The master tensor of `entry` of sub-model i (the owner's, for a replica): a view
        where the store keeps masters whole on the host, a new tensor elsewhere."""
        o, a, n = entry.owner, entry.owner_offset, entry.numel
        if self.mode != "split" and not self.on_disk(o):
            return self._masters[o][a:a + n].view(entry.shape)
        out = torch.empty(n, dtype=self.master_dtype)
        self.visit(o, a, a + n, lambda lo, hi: self.widen_master(o, lo, hi - lo,
                                                                 out[lo - a:hi - a]))
        return out.view(entry.shape)

    def write_master(self, i: int, values: torch.Tensor) -> None:
        """Set sub-model i's owned masters (flat, master order) and its own images; replicas
        of them elsewhere follow with `refresh_images(i)`."""
        values = values.reshape(-1).to(self.master_dtype)
        self.rewrite(i, lambda a, b: self.narrow_master(i, a, b - a, values[a:b]))

    def write_entries(self, i: int, items: Sequence[tuple[ParamEntry, Callable[[], torch.Tensor]]]
                      ) -> None:
        """Set the masters of owned entries of sub-model i from `items` ((entry, a function
        giving its value); `refresh_images(i)` after): in one pass over its states, each value
        asked for once, when its first elements are reached, and let go after its last."""
        items = sorted(items, key=lambda item: item[0].owner_offset)
        held: dict[str, torch.Tensor] = {}

        def change(a: int, b: int) -> None:
            for e, value in items:
                lo, hi = max(a, e.owner_offset), min(b, e.owner_offset + e.numel)
                if lo >= hi:
                    continue
                if e.key not in held:
                    held[e.key] = value().reshape(-1).to(self.master_dtype)
                flat = held[e.key]
                target = None if self.mode == "split" else self._part(i, "master", lo, hi)
                source = flat[lo - e.owner_offset:hi - e.owner_offset]
                if target is None or target.data_ptr() != source.data_ptr():
                    self.narrow_master(i, lo, hi - lo, source)
                if hi == e.owner_offset + e.numel:
                    held.pop(e.key, None)

        self.rewrite(i, change)

    def write_entry(self, i: int, entry: ParamEntry, value: torch.Tensor) -> None:
        """Set the master of owned `entry` of sub-model i (`refresh_images(i)` after)."""
        self.write_entries(i, [(entry, lambda: value)])

    def widen_master(self, i: int, start: int, n: int, out: torch.Tensor) -> None:
        """Masters [start, start + n) of sub-model i (master order) into `out`."""
        if self.mode == "split":
            self._widen_runs(i, self.runs[i], start, n, out)
        else:
            out.copy_(self._part(i, "master", start, start + n))

    def narrow_master(self, i: int, start: int, n: int, values: torch.Tensor) -> None:
        """Masters [start, start + n) of sub-model i from `values`, and their own images."""
        if self.mode == "split":
            self._narrow_runs(i, self.runs[i], start, n, values)
            return
        self._part(i, "master", start, start + n).copy_(values)
        if self.mode == "separate":  # cast into the transfer dtype (wide runs: into float32)
            for image, piece in self._run_pieces(i, None, start, n):
                image.copy_(values[piece])

    def checkpoint_masters(self, copy: bool, target: Path | None = None) -> dict[str, Any]:
        """The masters as a checkpoint holds them: per sub-model, its owned masters (copies
        with `copy`, else views where the store keeps them whole), or, from a split store
        without `copy`, its image and residual as they are (no float32 copy of the model at
        save time); a sub-model whose states are on disk: its record's files, hard-linked
        beside the run's under `target`'s name (the optimizer's state leaves its moments
        out: they are in the record), with the parts of its masters kept on the host
        (`host_parts`)."""
        out: list[Any] = []
        links = self.tier.files.link(target) if self.tier is not None and target else None
        for i in range(len(self.layouts)):
            if self.on_disk(i) and links is not None:
                out.append({"record": links[i], "kinds": sorted(self.disk_kinds[i]),
                            **self.host_parts(i)})
            elif self.mode == "split" and not copy and not self.on_disk(i):
                out.append({"image": self.image[i], "residual": self.residual[i]})
            else:
                master = self.read_master(i)
                out.append(master.clone() if copy and master is self._masters[i] else master)
        return {"masters": out}

    def host_parts(self, i: int) -> dict[str, torch.Tensor]:
        """The parts of a disk sub-model's masters kept on the host, by name: its image where
        it is (part of) the master ("direct": the master; "split": the high half), the
        residual or the separate master where the masters are not on disk."""
        kinds, out = self.disk_kinds[i], {}
        if "images" not in kinds and self.mode in ("direct", "split"):
            out["image"] = self.image[i]
        if "masters" not in kinds and self.mode == "split":
            out["residual"] = self.residual[i]
        if "masters" not in kinds and self.mode == "separate":
            out["master"] = self._masters[i]
        return out

    def check_checkpoint_masters(self, state: dict[str, Any]) -> str:
        """What is wrong with a checkpoint's masters for this store, or ""."""
        masters = state["masters"]
        if len(masters) != len(self.layouts):
            return f"it has masters of {len(masters)} sub-models, expected {len(self.layouts)}"
        for i, (m, L) in enumerate(zip(masters, self.layouts)):
            if isinstance(m, dict) and "record" in m:
                if not self.on_disk(i) or sorted(self.disk_kinds[i]) != m.get("kinds"):
                    here = ", ".join(sorted(self.disk_kinds[i])) or "none"
                    return (f"sub-model {i}'s {', '.join(m.get('kinds') or [])} are on disk in "
                            f"it, and this run keeps {here} there; resume with the plan it "
                            f"was written with")
                missing = [f for f in m["record"] if not Path(f).is_file()]
                if missing:
                    return (f"sub-model {i}'s state file {missing[0]} is gone; the checkpoint's "
                            f"files on the offload drives must stay with it")
                for name, t in self.host_parts(i).items():
                    saved = m.get(name)
                    if not isinstance(saved, torch.Tensor) or saved.shape != t.shape:
                        return f"the {name} of sub-model {i} is missing or has another size"
            elif isinstance(m, dict):
                if self.mode != "split" or self.on_disk(i):
                    return ("its masters are bfloat16 images with their residuals (a run with "
                            "--transfer-dtype bfloat16, on the host); resume with that run's "
                            "settings")
                image, residual = m.get("image"), m.get("residual")
                if (not isinstance(image, torch.Tensor) or not isinstance(residual, torch.Tensor)
                        or image.shape != self.image[i].shape
                        or residual.shape != self.residual[i].shape):
                    return f"the image or residual of sub-model {i} has another size"
            elif not isinstance(m, torch.Tensor) or tuple(m.shape) != (L.owned_numel,):
                return (f"master weights of sub-model {i} have shape "
                        f"{getattr(m, 'shape', None)}, expected ({L.owned_numel},)")
        return ""

    def load_checkpoint_masters(self, state: dict[str, Any]) -> None:
        """Set the masters from a checkpoint's (check_checkpoint_masters first), then every
        replica of them."""
        for i, m in enumerate(state["masters"]):
            if isinstance(m, dict) and "record" in m:
                assert self.tier is not None
                self.tier.files.adopt(i, m["record"])
                self.tier.version[i] += 1
                for name, t in self.host_parts(i).items():
                    t.copy_(m[name])
                if self.mode == "separate" and "images" not in self.disk_kinds[i]:
                    self.refresh_images(i)
            elif isinstance(m, dict):
                self.image[i].copy_(m["image"])
                self.residual[i].copy_(m["residual"])
            else:
                self.write_master(i, m)
        for i in range(len(self.layouts)):
            self.refresh_replicas(i)

    def bind(self, host_modules: list[nn.Module],
             written: Callable[[int], None] | None = None) -> None:
        """The masters take the weights of `host_modules` (one copy of the package's
        sub-models). Their parameters then become views of the masters where the store keeps
        them whole on the host (what state dicts of them read), and meta tensors elsewhere
        (the store is read instead: read_entry); the images are made from the masters. A
        parameter on the meta device has no value to take: its master stays zero until the
        caller fills it (weights read from files straight into the masters, or a resumed
        checkpoint). States on disk are written there first, sub-model by sub-model
        (`written(i)` after each)."""
        for i, (mod, L) in enumerate(zip(host_modules, self.layouts)):
            params = dict(mod.named_parameters())
            with torch.no_grad():
                self.write_entries(i, [(e, lambda p=params[e.local]: p) for e in L.entries
                                       if e.owned and not params[e.local].is_meta])
            whole = self.mode != "split" and not self.on_disk(i)
            views = {e.local: (self.read_entry(i, e) if whole
                               else torch.empty(e.shape, dtype=self.master_dtype, device="meta"))
                     for e in L.entries}
            rebind_parameters(mod, views, requires_grad=False)
            if written is not None:
                written(i)
        for i in range(len(self.layouts)):
            self.refresh_replicas(i)

    # ---- images --------------------------------------------------------------------------------

    def refresh_images(self, i: int) -> None:
        """Bring images up to date with sub-model i's master: its own, and every replica of it
        (after the masters were set in place, e.g. by a peers' average)."""
        if self.mode == "separate":
            self.rewrite(i, lambda a, b: self.narrow_master(
                i, a, b - a, self._part(i, "master", a, b).clone()))
        self.refresh_replicas(i)

    def refresh_replicas(self, i: int, trained_only: bool = False) -> None:
        """The replicas of sub-model i's weights in later images, from its own image (frozen
        ones never change: `trained_only` skips them). The plan keeps the images of the
        sub-models holding replicas on the host; the owner's may be on disk."""
        owned = self._owned[i]
        for j, e in self.replicas_of[i]:
            if trained_only and not e.trainable:
                continue
            assert self.image[j] is not None, f"sub-model {j} holds a replica: its image stays"
            o = owned[e.key]
            target = e.image_view(self.image[j]).reshape(-1)

            def copy(a: int, b: int, o: ParamEntry = o, target: torch.Tensor = target) -> None:
                wide = o.wide
                lo, hi = a - o.owner_offset, b - o.owner_offset
                target[lo:hi].copy_(self._in_run(i, None, o.offset, wide, lo, hi))

            self.visit(i, o.owner_offset, o.owner_offset + o.numel, copy)

    # ---- gradients -----------------------------------------------------------------------------

    def grad(self, i: int) -> torch.Tensor:
        """Sub-model i's host gradient buffer (taken with `grads.acquire`)."""
        return self.grads.tensor(i)

    def master_grad(self, i: int) -> torch.Tensor:
        """The gradient of sub-model i's trainable masters as one flat tensor: a view of its
        gradient buffer, in a "direct" store only (elsewhere the update widens it)."""
        assert self.mode == "direct", "only a direct store keeps its masters' gradient whole"
        return self.grad(i)[:self.layouts[i].trainable_numel]

    def fold_replicas(self, j: int) -> None:
        """In a ring: the gradients of sub-model j's trainable replicas (tied weights owned by
        an earlier sub-model) into their owners' tied sums, before j's buffer goes back."""
        if not self.grads.ring:
            return
        grad = self.grad(j)
        for e in self.layouts[j].entries:
            if not e.owned and e.trainable and e.key not in self.exact_keys:
                self.tied_sums[e.key] += e.grad_view(grad).reshape(-1)

    def widen_grad(self, i: int, start: int, n: int, out: torch.Tensor) -> None:
        """Gradients of sub-model i's trainable masters [start, start + n) (master order) into
        `out` in the master dtype: its own, plus those of every replica of them (a tie's
        holders; one rounding away from the model's own sum, see atomc.runtime.ties)."""
        grad = self.grad(i)
        for image, piece in self._run_pieces(i, grad, start, n, trained=True):
            out[piece].copy_(image)
        self._add_replicas(i, start, n, out)

    def add_replica_grads(self, i: int) -> None:
        """Where sub-model i's gradient buffer is its masters' gradient ("direct" store): its
        replicas' gradients added into it in place, before its update."""
        L = self.layouts[i]
        self._add_replicas(i, 0, L.trainable_numel, self.grad(i)[:L.trainable_numel])

    def _add_replicas(self, i: int, start: int, n: int, out: torch.Tensor) -> None:
        stop = start + n
        if self.grads.ring:
            for e in self.layouts[i].entries:
                tied = self.tied_sums.get(e.key) if e.owned and e.trainable else None
                if tied is None:
                    continue
                a, b = max(start, e.owner_offset), min(stop, e.owner_offset + e.numel)
                if a < b:
                    out[a - start:b - start] += tied[a - e.owner_offset:b - e.owner_offset]
            return
        for j, e in self.replicas_of[i]:
            if not e.trainable or e.key in self.exact_keys:
                continue
            a, b = max(start, e.owner_offset), min(stop, e.owner_offset + e.numel)
            if a < b:
                view = e.grad_view(self.grad(j)).reshape(-1)
                out[a - start:b - start] += view[a - e.owner_offset:b - e.owner_offset]

    def clear_tied_sums(self, i: int) -> None:
        """After sub-model i's update: its tied weights' sums start the next step at zero."""
        for e in self.layouts[i].entries:
            tied = self.tied_sums.get(e.key) if e.owned else None
            if tied is not None:
                tied.zero_()

    # ---- runs ----------------------------------------------------------------------------------

    def _run_pieces(self, i: int, flat: torch.Tensor | None, start: int, n: int,
                    trained: bool = False) -> list[tuple[torch.Tensor, slice]]:
        """(part of `flat` in image layout, its slice of [start, start + n) in master order)
        for every owned run (trainable only: `trained`) overlapping it; `flat` None: of the
        sub-model's image (a staged window's, where it is on disk)."""
        out = []
        stop = start + n
        for i_off, _span, m_off, count, wide in (self.trained_runs if trained else self.runs)[i]:
            a, b = max(start, m_off), min(stop, m_off + count)
            if a >= b:
                continue
            out.append((self._in_run(i, flat, i_off, wide, a - m_off, b - m_off),
                        slice(a - start, b - start)))
        return out

    def _in_run(self, i: int, flat: torch.Tensor | None, i_off: int, wide: bool, a: int,
                b: int) -> torch.Tensor:
        """Weights [a, b) of a run starting at image element `i_off` (in the run's own dtype:
        float32 for a wide one), of `flat` or (None) the sub-model's image."""
        r = self._wide_ratio if wide else 1
        lo, hi = i_off + r * a, i_off + r * b
        part = flat[lo:hi] if flat is not None else self._part(i, "image", lo, hi)
        return part.view(WIDE_DTYPE) if wide else part

    def _part(self, i: int, name: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of sub-model i's `name` ("image", "master", "residual", "exp_avg",
        "exp_avg_sq"): of its host buffer, or of the staged window holding them."""
        if name == "master" and self.mode == "direct":
            name = "image"  # a direct store's master is its image
        t = {"image": self.image, "master": self._masters, "residual": self.residual}[name][i] \
            if name in ("image", "master", "residual") \
            else self.moments[i][0 if name == "exp_avg" else 1]
        base = self._bases[i].get(name, 0)
        if a < base or b - base > t.numel():
            raise RuntimeError(f"elements {a}..{b} of sub-model {i}'s {name} are not staged "
                               f"(the window holds {base}..{base + t.numel()})")
        return t[a - base:b - base]

    def _widen_runs(self, i: int, runs: list, start: int, n: int, out: torch.Tensor) -> None:
        for i_off, _span, m_off, count, wide in runs:
            a, b = max(start, m_off), min(start + n, m_off + count)
            if a >= b:
                continue
            target = out[a - start:b - start]
            part = self._in_run(i, None, i_off, wide, a - m_off, b - m_off)
            if wide:  # kept whole in the image
                target.copy_(part)
            else:
                join_master(part.view(torch.int16), self._part(i, "residual", a, b), target)

    def _narrow_runs(self, i: int, runs: list, start: int, n: int, values: torch.Tensor) -> None:
        for i_off, _span, m_off, count, wide in runs:
            a, b = max(start, m_off), min(start + n, m_off + count)
            if a >= b:
                continue
            source = values[a - start:b - start]
            part = self._in_run(i, None, i_off, wide, a - m_off, b - m_off)
            if wide:
                part.copy_(source)
            else:
                split_master(source.contiguous(), part.view(torch.int16),
                             self._part(i, "residual", a, b))

    def image_at(self, i: int, a: int) -> int:
        """The image element master element `a` of sub-model i is at (its owned weights' end
        for a = its owned count)."""
        runs = self.runs[i]
        for i_off, _span, m_off, count, wide in runs:
            if m_off <= a < m_off + count:
                return i_off + (self._wide_ratio if wide else 1) * (a - m_off)
        return max((i_off + span for i_off, span, *_ in runs), default=0)

    def moment_part(self, i: int, m: int, a: int, b: int) -> torch.Tensor:
        """Moment `m` (0: exp_avg, 1: exp_avg_sq) of sub-model i's trainable [a, b)."""
        return self._part(i, "exp_avg" if m == 0 else "exp_avg_sq", a, b)

    # ---- sizes ---------------------------------------------------------------------------------

    def param_bytes(self, i: int) -> int:
        return self.layouts[i].numel * self.transfer_dtype.itemsize

    def pinned_bytes(self) -> int:
        """Pinned host memory the store's arenas took (their bytes as the allocator rounds them)."""
        return self.image_arena.pinned_bytes() + self.grads.pinned_bytes()

    def planned_bytes(self, optimizer_states: str = "float32") -> dict[str, int]:
        """Host bytes by kind by the plan's formula for this store (no activation stash)."""
        return planned_host_bytes(self.layouts, self.master_dtype, self.transfer_dtype,
                                  optimizer_states,
                                  grad_slots=self.grads.num_slots if self.grads.ring else None,
                                  disk_kinds=self.disk_kinds)

    def host_bytes(self) -> int:
        """Bytes the store allocated on the host: images, gradient buffers, masters or
        residuals, moments and tied sums, and the disk tier's staging slots and image ring
        (call it with no window staged)."""
        def size(ts: Any) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        total = self.image_arena.nbytes + self.grads.arena.nbytes
        total += size(self.residual) + size(m for pair in self.moments if pair for m in pair)
        total += size(self.tied_sums.values())
        if self.mode == "separate":
            total += size(self._masters)
        if self.tier is not None:
            total += size(self.tier.staging) + size(self.tier.ring)
        return total


def planned_host_bytes(layouts: Sequence[SubLayout], master_dtype: torch.dtype,
                       transfer_dtype: torch.dtype, optimizer_states: str = "float32",
                       stash_bytes: int = 0, sent_bytes: int = 0,
                       grad_slots: int | None = None,
                       disk_kinds: Sequence[frozenset[str]] = ()) -> dict[str, int]:
    """Host bytes by kind a store of `layouts` and its optimizer take, with `stash_bytes` of
    stashed boundary values and `sent_bytes` of sent operator outputs (atomc.partition.hostmem):
    what `atomc train` checks before it allocates anything."""
    name = str(master_dtype).removeprefix("torch."), str(transfer_dtype).removeprefix("torch.")
    return host_bytes_by_kind([L.weights() for L in layouts], name[0], name[1],
                              optimizer_states, stash_bytes, sent_bytes, grad_slots, disk_kinds)


def rebind_parameters(module: nn.Module, tensors: dict[str, torch.Tensor], requires_grad: bool,
                      grads: dict[str, torch.Tensor] | None = None) -> None:
    """Make each parameter of `module` a Parameter over the given tensor (a view of a flat buffer).

    A Parameter registered under several names in the module stays one Parameter; one the
    module has frozen (requires_grad=False) stays frozen.
    """
    new_of: dict[int, nn.Parameter] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) not in new_of:
            if name not in tensors:
                raise KeyError(name)
            new = nn.Parameter(tensors[name], requires_grad=requires_grad and p.requires_grad)
            if grads is not None and new.requires_grad:  # a frozen one has no gradient buffer
                new.grad = grads[name]
            new_of[id(p)] = new
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, new_of[id(p)])
