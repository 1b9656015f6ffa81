"""Runtime stage, host store: every sub-model's weights, gradients and optimizer moments in flat
host buffers, or (the states the plan puts there) in files on NVMe drives.

Input: the layouts of the sub-models (atomc.runtime.layouts: where each weight lies) and the
plan's host settings (gradient slots, the kinds of states on disk). Output: a `HostStore`
with, per sub-model i,

- `image[i]`: the flat buffer the device loads in ONE copy (transfer dtype; pinned on CUDA,
  in one arena: atomc.runtime.pinned).
- the masters, the owned weights in the master dtype, kept one of three ways (`store_mode`,
  atomc.runtime.masters): "direct" (the image is the master: same dtype), "split" (float32
  masters, bfloat16 image: the image is each master's high half and `residual[i]`, int16, its
  low half, so masters cost 4 bytes with their images), "separate" (a buffer of their own,
  cast into the image after each update). `read_master`, `widen_master` and `narrow_master`
  read and write them whichever way they are kept.
- `moments[i]`: AdamW's two moments of the owned trainable weights, flat in master order
  (the master dtype, or bfloat16).
- gradients: the flat buffer the device's gradients come back into in ONE copy (pinned), from
  `grads` (atomc.runtime.gradbuffers): one per sub-model, or a ring of the sub-models in flight
  where no clipping or loss scaling waits for every gradient (`acquire`/`release`). Trainable
  weights only: a frozen weight (a LoRA model's base) has no gradient buffer, no optimizer
  state and is never updated or re-cast.
- states on disk (`disk_kinds[i]`: moments, masters beyond the image, the image): one record
  per sub-model in `tier` (atomc.runtime.tier), streamed a segment at a time through staging
  buffers; while a segment is staged, the views above are views of it (`rewrite`, `visit`),
  and an image on disk is loaded from the tier's pinned ring (`load_source`).

A tied parameter has one master and one optimizer state (in its first holder, the lowest
sub-model index); each holder's image carries a replica refreshed from that master after
every update, so every holder is loaded with the same weights. With a gradient ring, the
holders' gradients are summed into `tied_sums` as they give their buffers back. The residuals
and moments are not pinned (the device never reads them). A checkpoint's masters:
atomc.runtime.masterstate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from atomc.partition import hostmem
from atomc.partition.hostmem import MOMENTS_PER_WEIGHT
from atomc.runtime.disk import DriveCheck, StateFiles
from atomc.runtime.gradbuffers import GradBuffers
from atomc.runtime.layouts import (
    WIDE_DTYPE,
    ParamEntry,
    SubLayout,
    planned_host_bytes,
    rebind_parameters,
    trainable_places,
)
from atomc.runtime.masters import join_master, split_master, store_mode
from atomc.runtime.pinned import HostArena, register_pinned
from atomc.runtime.tier import (
    DiskTier,
    Window,
    record_regions,
    record_size,
    segments,
    update_chunks,
)


def moment_dtype(states: str, master_dtype: torch.dtype) -> torch.dtype:
    """The dtype AdamW's moments are kept in: the masters' ("float32" names the default, full
    precision: a float64 run's moments are float64), or bfloat16."""
    return master_dtype if states == "float32" else getattr(torch, states)


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

