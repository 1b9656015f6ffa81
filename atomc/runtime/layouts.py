"""Runtime, host layouts: where every weight of every sub-model lies in the flat host buffers.

Input: the generated package's PARAM_NAMES/TIED and one built copy of the sub-models. Output:
per sub-model a `SubLayout`, its image's entries in order: [owned decayed params | owned
undecayed params | replicas], where a replica is a tied parameter whose master lives in an
earlier sub-model, with frozen weights after the trainable ones of each part. The host store
(atomc.runtime.store) allocates its buffers by these layouts; `planned_host_bytes` sizes them
by the plan's formula (atomc.partition.hostmem) before anything is allocated.

A tied parameter has one master and one optimizer state, in its first holder (the lowest
sub-model index); each other holder's image carries a replica of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from atomc.errors import RuntimeMismatchError
from atomc.partition.hostmem import SubmodelWeights, host_bytes_by_kind
from atomc.runtime.package import SwapPackage

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
    weights = [_submodel_weights(package, i, mod) for i, mod in enumerate(modules)]
    planner = _Planner(package, [names for names, _, _ in weights], decay_filter, transfer_dtype)
    for i, (names, shapes, trains) in enumerate(weights):
        planner.layouts.append(planner.place_submodel(i, names, shapes, trains))
    layouts = planner.layouts
    replicated = {e.key for L in layouts for e in L.entries if not e.owned and e.trainable}
    return [dataclasses.replace(L, shared_numel=sum(e.numel for e in L.entries if e.owned
                                                    and e.key in replicated))
            for L in layouts]


def _submodel_weights(package: SwapPackage, i: int, mod: nn.Module
                      ) -> tuple[dict[str, str], dict[str, tuple[int, ...]], dict[str, bool]]:
    """Sub-model i's PARAM_NAMES without the buffers it also maps, its parameters' shapes and
    whether each is trainable (requires_grad: False for a weight the model freezes), checked
    against each other."""
    named = {n: tuple(p.shape) for n, p in mod.named_parameters()}
    trains = {n: p.requires_grad for n, p in mod.named_parameters()}
    buffers = {n for n, _ in mod.named_buffers()}
    listed = package.param_names[i]
    lacking = sorted(set(named) - set(listed))
    unknown = sorted(set(listed) - set(named) - buffers)
    if lacking or unknown:
        raise RuntimeMismatchError(
            f"sub-model {i} of {package.path} has parameters {lacking} that PARAM_NAMES does "
            f"not map, and PARAM_NAMES names {unknown}, which it does not have; the package "
            f"is damaged, regenerate it")
    return {local: fqn for local, fqn in listed.items() if local in named}, named, trains


# (local name, key, shape, decay) of one weight a sub-model holds
_Held = tuple[str, str, tuple[int, ...], bool]


class _Planner:
    """What plan_layouts carries from one sub-model to the next: each key's owner (its first
    holder), whether it is trainable (a tied weight's holders follow its owner), the layouts
    placed so far, and the image's element ratio for wide entries."""

    def __init__(self, package: SwapPackage, param_names: list[dict[str, str]],
                 decay_filter: DecayFilter | None, transfer_dtype: torch.dtype | None):
        half = transfer_dtype is not None and transfer_dtype.itemsize < WIDE_DTYPE.itemsize
        self.ratio = WIDE_DTYPE.itemsize // transfer_dtype.itemsize if half else 1
        self.wide_keys = set(package.full_precision) if half else set()
        self.tie_key = {(i, local): key for key, holders in package.tied.items()
                        for i, local in holders}
        self.decay_filter = decay_filter
        self.owner_of: dict[str, int] = {}
        for i, names in enumerate(param_names):
            for local in names:
                key = self.tie_key.get((i, local), names[local])
                self.owner_of.setdefault(key, i)
        self.trainable_of: dict[str, bool] = {}
        self.layouts: list[SubLayout] = []
        self.offset = 0  # the image element the next entry of the current sub-model starts at

    def place_submodel(self, i: int, names: dict[str, str], shapes: dict[str, tuple[int, ...]],
                       trains: dict[str, bool]) -> SubLayout:
        """Sub-model i's layout: its owned weights (decayed, plain, frozen), then its replicas
        (trainable first)."""
        owned_decay, owned_plain, owned_frozen, replicas = self._sort(i, names, shapes, trains)
        self.offset = 0
        entries: list[ParamEntry] = []
        grad_end = self._place_owned(i, owned_decay + owned_plain + owned_frozen, entries)
        owned = sum(e.numel for e in entries)
        decay_numel = sum(math.prod(s) for _, _, s, _ in owned_decay)
        trainable_numel = decay_numel + sum(math.prod(s) for _, _, s, _ in owned_plain)
        replicas.sort(key=lambda r: not self.trainable_of[r[1]])  # trainable first, order kept
        grad_end = self._place_replicas(i, replicas, entries, grad_end)
        return SubLayout(i, tuple(entries), self.offset, owned, decay_numel, trainable_numel,
                         grad_end)

    def _sort(self, i: int, names: dict[str, str], shapes: dict[str, tuple[int, ...]],
              trains: dict[str, bool]) -> tuple[list[_Held], ...]:
        """Sub-model i's weights as (owned decayed, owned plain, owned frozen, replicas); the
        owned ones' trainability recorded for their holders."""
        owned_decay, owned_plain, owned_frozen, replicas = [], [], [], []
        seen_here: set[str] = set()
        for local, fqn in names.items():
            key = self.tie_key.get((i, local), fqn)
            shape = shapes[local]
            decay = True if self.decay_filter is None else bool(self.decay_filter(key, shape))
            if self.owner_of[key] == i and key not in seen_here:
                group = (owned_frozen if not trains[local]
                         else owned_decay if decay else owned_plain)
                group.append((local, key, shape, decay))
                self.trainable_of[key] = trains[local]
                seen_here.add(key)
            else:
                replicas.append((local, key, shape, decay))
        return owned_decay, owned_plain, owned_frozen, replicas

    def _place(self, key: str, n: int) -> tuple[int, int, bool]:
        """(start, span, wide) of a weight of `n` elements at the image's end."""
        wide = key in self.wide_keys
        if wide:
            self.offset = -(-self.offset // self.ratio) * self.ratio  # a whole WIDE_DTYPE element
        start, span = self.offset, n * self.ratio if wide else n
        self.offset += span
        return start, span, wide

    def _place_owned(self, i: int, owned: list[_Held], entries: list[ParamEntry]) -> int:
        """The owned weights' entries into `entries`, in order; returns where their gradients
        end."""
        grad_end = master_offset = 0
        for local, key, shape, decay in owned:
            n = math.prod(shape)
            start, span, wide = self._place(key, n)
            trainable = self.trainable_of[key]
            entries.append(ParamEntry(local, key, shape, n, start, i, master_offset, decay, True,
                                      span, wide, trainable, start if trainable else -1))
            grad_end = self.offset if trainable else grad_end
            master_offset += n
        return grad_end

    def _place_replicas(self, i: int, replicas: list[_Held], entries: list[ParamEntry],
                        grad_end: int) -> int:
        """The replicas' entries after the owned ones, their gradients after `grad_end`;
        returns where the gradients end."""
        for local, key, shape, decay in replicas:
            n = math.prod(shape)
            o = self.owner_of[key]
            if o > i:  # pragma: no cover - owner_of takes the first holder
                raise AssertionError("a tie's owner comes after its holder")
            owner = next(e for e in (entries if o == i else self.layouts[o].entries)
                         if e.key == key and e.owned)
            if owner.shape != shape:
                raise RuntimeMismatchError(
                    f"tied parameter {key} has shape {list(owner.shape)} in sub-model {o} but "
                    f"{list(shape)} in sub-model {i} ({local}); the package is damaged, "
                    f"regenerate it")
            start, span, wide = self._place(key, n)
            trainable, g_start = self.trainable_of[key], -1
            if trainable:
                if wide:
                    grad_end = -(-grad_end // self.ratio) * self.ratio
                g_start, grad_end = grad_end, grad_end + span
            entries.append(ParamEntry(local, key, shape, n, start, o, owner.owner_offset, decay,
                                      False, span, wide, trainable, g_start))
        return grad_end


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
