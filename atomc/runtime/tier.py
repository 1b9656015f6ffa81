"""Runtime, the host store's disk tier: which of each sub-model's states live in files, and the
host buffers they stream through (atomc.runtime.disk does the I/O).

A sub-model's states are its image (what the GPU loads), the masters beyond the image (a split
store's residual, a separate store's float32 copy) and AdamW's two moments. The plan puts
each kind of each sub-model on the host or on disk (`disk_kinds`); what is on disk is one
record per sub-model, its regions in the order image, masters, moments, each ALIGN-aligned.

- Streamed in segments: a record is read, changed and written a segment at a time, a
  segment being a run of master elements (whole update chunks, `update_chunks`, at most
  SEGMENT elements) and, in each region, the bytes those elements take, ALIGN-aligned
  outwards. A rewrite (`rewrite`: the update, or weights set) reads segment k+1 of the record
  while segment k is changed and k-1 is written to the record's new generation; the bytes two
  neighbouring segments share (the alignment) are carried from the one changed to the next,
  and each segment writes up to where the next begins, so the new generation is whole when
  it is committed. `visit` reads segments without writing (the masters read for an export).
  While a segment is staged, the store's views of that sub-model's disk states are views of
  its slot, based at the segment's first element (`Window`).
- The image ring: a load of a sub-model whose image is on disk copies to the GPU from one of
  IMAGE_SLOTS pinned buffers, read ahead in the direction the loads go (`image`), and kept
  until its image changes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from atomc.partition.hostmem import DISK_KINDS, IMAGE_SLOTS, STAGING_SLOTS
from atomc.partition.hostmem import DISK_SEGMENT as SEGMENT
from atomc.runtime.disk import ALIGN, StateFiles, aligned, aligned_buffer


def update_chunks(wheres: Sequence[slice], chunk: int) -> list[list[tuple[int, int, int]]]:
    """The chunks the update computes in: the weights at `wheres` (master order) cut at
    multiples of `chunk` from each one's start, packed in order into chunks of at most
    `chunk` elements; each chunk a list of (master offset, elements, weight)."""
    pieces = sorted((start, min(where.stop, start + chunk) - start, k)
                    for k, where in enumerate(wheres)
                    for start in range(where.start, where.stop, chunk))
    out: list[list[tuple[int, int, int]]] = []
    filled = chunk + 1
    for piece in pieces:
        if filled + piece[1] > chunk:
            out.append([])
            filled = 0
        out[-1].append(piece)
        filled += piece[1]
    return out


@dataclass(frozen=True)
class Region:
    name: str  # "image", "master", "residual", "exp_avg", "exp_avg_sq"
    offset: int  # bytes into the record
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def end(self) -> int:
        """Where the region's aligned span ends in the record."""
        return self.offset + aligned(self.nbytes)


def record_regions(kinds: frozenset[str], image: tuple[int, torch.dtype],
                   masters: tuple[str, int, torch.dtype] | None,
                   moments: tuple[int, torch.dtype]) -> list[Region]:
    """The regions of one sub-model's record for the kinds on disk: its image (numel, dtype),
    the masters beyond it ((name, numel, dtype), None where the image is the master) and its
    moments (numel, dtype each), in that order, each ALIGN-aligned (hostmem.record_size)."""
    wanted: list[tuple[str, int, torch.dtype]] = []
    if "images" in kinds:
        wanted.append(("image", *image))
    if "masters" in kinds and masters is not None:
        wanted.append(masters)
    if "moments" in kinds:
        wanted += [("exp_avg", *moments), ("exp_avg_sq", *moments)]
    out, offset = [], 0
    for name, numel, dtype in wanted:
        out.append(Region(name, offset, numel, dtype))
        offset = aligned(offset + numel * dtype.itemsize)
    return out


def record_size(regions: Sequence[Region]) -> int:
    return regions[-1].end if regions else 0


@dataclass(frozen=True)
class Segment:
    """A run of a sub-model's master elements [start, stop) and the record bytes it stages:
    per region (name, first byte, end byte, where its write ends: the next segment's first
    byte, or the region's end)."""

    index: int
    start: int
    stop: int
    spans: tuple[tuple[str, int, int, int], ...]
    chunks: tuple[int, int]  # the update chunks it holds: [first, last + 1)

    @property
    def nbytes(self) -> int:
        return sum(aligned(hi - lo) for _, lo, hi, _ in self.spans)


def segments(regions: Sequence[Region], chunk_starts: Sequence[int], owned: int,
             trainable: int, image_at: Callable[[int], int]) -> list[Segment]:
    """The segments of one record: master elements cut at update chunk starts (`chunk_starts`,
    ascending, over the trainable [0, trainable)), at most SEGMENT each where the chunks allow,
    then the frozen rest [trainable, owned) SEGMENT at a time. A region's bytes for elements
    [a, b): the image's at image_at(a)..image_at(b) (the image positions of master
    elements), the masters' at a..b, the moments' at a..b within [0, trainable)."""
    cuts = [0]
    ends = [*chunk_starts[1:], trainable]
    for start, end in zip(chunk_starts, ends):
        if end - cuts[-1] > SEGMENT and start > cuts[-1]:
            cuts.append(start)
    if trainable > cuts[-1]:
        cuts.append(trainable)
    while cuts[-1] < owned:
        cuts.append(min(owned, cuts[-1] + SEGMENT))
    if len(cuts) == 1:
        cuts.append(0)  # one (empty) segment: the record's regions whole
    bounds = list(itertools.pairwise(cuts))

    def elems(r: Region, a: int) -> int:
        if r.name == "image":
            return image_at(a)
        if r.name in ("exp_avg", "exp_avg_sq"):
            return min(a, trainable)
        return a

    firsts = {r.name: [r.offset + (elems(r, a) * r.dtype.itemsize) // ALIGN * ALIGN if k
                       else r.offset for k, (a, _) in enumerate(bounds)] for r in regions}
    out = []
    for k, (a, b) in enumerate(bounds):
        last = k == len(bounds) - 1
        spans = []
        for r in regions:
            lo = firsts[r.name][k]
            hi = r.end if last else min(r.end, r.offset + aligned(elems(r, b)
                                                                   * r.dtype.itemsize))
            upto = r.end if last else firsts[r.name][k + 1]
            spans.append((r.name, lo, max(lo, hi), upto))
        held = [c for c, s in enumerate(chunk_starts) if a <= s < b]
        chunks = (held[0], held[-1] + 1) if held else (0, 0)
        out.append(Segment(k, a, b, tuple(spans), chunks))
    return out


@dataclass
class Window:
    """A staged segment: the slot's views of its regions, each with the index (in that
    region's elements) of its first element."""

    segment: Segment
    views: dict[str, torch.Tensor]
    bases: dict[str, int]


class DiskTier:
    """The segment slots and the image ring over `files` (see the module docstring). `bind(i,
    window)` sets the store's views of sub-model i's disk states to a window's (None: clears
    them)."""

    def __init__(self, files: StateFiles, regions: list[list[Region]],
                 segment_lists: list[list[Segment]],
                 bind: Callable[[int, Window | None], None],
                 pin: Callable[[torch.Tensor], None] | None):
        self.files = files
        self.regions = regions
        self.segments = segment_lists
        self._bind = bind
        largest = max((s.nbytes for segs in segment_lists for s in segs), default=0)
        self.staging = ([aligned_buffer(largest) for _ in range(STAGING_SLOTS)]
                        if largest else [])
        image_bytes = max((r[0].nbytes for r in regions if r and r[0].name == "image"),
                          default=0)
        self.ring = [aligned_buffer(image_bytes) for _ in range(IMAGE_SLOTS)] if image_bytes \
            else []
        for buf in self.ring:
            if pin is not None:
                pin(buf)
        self._lock = threading.Condition()
        self._free = list(range(len(self.staging)))
        # record -> (slot, read, version) of its first segment, read ahead
        self._prefetched: dict[int, tuple[int, Future, int]] = {}
        self._ring: list[tuple[int, int, Future] | None] = [None] * len(self.ring)
        self._ring_busy: list[Any] = [None] * len(self.ring)  # a copy's event, CUDA
        self._ages = [0] * len(self.ring)  # when each ring slot was last read into
        self._clock = 0
        self.version = [0] * len(regions)  # bumped by each rewrite of a record

    def on_disk(self, i: int) -> bool:
        return bool(self.regions[i])

    # ---- slots ---------------------------------------------------------------------------------

    def _take(self) -> int:
        with self._lock:
            while not self._free:
                self._lock.wait()
            return self._free.pop()

    def _give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
            self._lock.notify_all()

    def _layout(self, i: int, seg: Segment, slot: int) -> Window:
        buf = self.staging[slot]
        views, bases, pos = {}, {}, 0
        regions = {r.name: r for r in self.regions[i]}
        for name, lo, hi, _ in seg.spans:
            r = regions[name]
            views[name] = buf[pos:pos + hi - lo].view(r.dtype)
            bases[name] = (lo - r.offset) // r.dtype.itemsize
            pos += aligned(hi - lo)
        return Window(seg, views, bases)

    def _read(self, i: int, seg: Segment, slot: int, generation: int | None) -> Future:
        buf = self.staging[slot]
        reads, pos = [], 0
        for _, lo, hi, _ in seg.spans:
            if hi > lo:
                reads.append(self.files.read(i, buf[pos:], lo, hi - lo, generation=generation))
            pos += aligned(hi - lo)
        done: Future = Future()
        remaining = [len(reads)]
        lock = threading.Lock()

        def finished(f: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if f.exception() is not None and not done.done():
                done.set_exception(f.exception())
            elif last and not done.done():
                done.set_result(None)

        if not reads:
            done.set_result(None)
        for r in reads:
            r.add_done_callback(finished)
        return done

    def prefetch(self, i: int) -> None:
        """Start reading record i's first segment, where a slot is free now (never waits)."""
        with self._lock:
            if (not self.on_disk(i) or i in self._prefetched or not self._free
                    or self.files.generation[i] < 0):
                return
            slot = self._free.pop()
            self._prefetched[i] = (slot, self._read(i, self.segments[i][0], slot, None),
                                   self.version[i])

    # ---- streaming -----------------------------------------------------------------------------

    def rewrite(self, i: int, change: Callable[[Window], None]) -> Future:
        """Record i read, changed and written a segment at a time (see the module docstring):
        `change(window)` for each segment while its window is bound in the store; a record
        never written starts from zeros. Returns when every segment is changed; the returned
        future when the new generation is the record."""
        self.files.settled(i)  # the generation it replaces is whole
        segs = self.segments[i]
        with self._lock:
            self.version[i] += 1  # with the write below: a ring read waits for it or is stale
            old = self.files.generation[i]
            writer = self.files.begin_write(i)
        staged: dict[int, tuple[int, Future | None]] = {}

        def stage(k: int) -> None:
            if k in staged or k >= len(segs):
                return
            first = self._prefetched.pop(i, None) if k == 0 else None
            if first is not None:
                slot, read, version = first
                if version == self.version[i] - 1:  # read of the generation it replaces
                    staged[k] = (slot, read)
                    return
                read.result()
                self._give(slot)
            slot = self._take()
            if old < 0:
                self.staging[slot].zero_()
                staged[k] = (slot, None)
            else:
                staged[k] = (slot, self._read(i, segs[k], slot, old))

        stage(0)
        for k, seg in enumerate(segs):
            stage(k + 1)  # read ahead while this one changes
            slot, read = staged[k]
            if read is not None:
                read.result()
            window = self._layout(i, seg, slot)
            self._bind(i, window)
            try:
                change(window)
            finally:
                self._bind(i, None)
            if k + 1 < len(segs):  # the bytes both hold go on in their changed state
                nslot, nread = staged[k + 1]
                if nread is not None:
                    nread.result()
                    staged[k + 1] = (nslot, None)
                nxt = self._layout(i, segs[k + 1], nslot)
                for (name, lo, hi, _), (_, nlo, _, _) in zip(seg.spans, segs[k + 1].spans):
                    if nlo < hi:
                        size = window.views[name].element_size()
                        n = (hi - nlo) // size
                        nxt.views[name][:n].copy_(window.views[name][(nlo - lo) // size:])
            buf = self.staging[slot]
            for (_, lo, _, upto), pos in zip(seg.spans, _positions(seg)):
                if upto > lo:
                    writer.put(lo, buf[pos:pos + upto - lo])
            writer.put(0, buf[:0], done=lambda s=slot: self._give(s))
        return writer.commit()

    def visit(self, i: int, start: int, stop: int, see: Callable[[Window], None]) -> None:
        """`see(window)` for each segment of record i holding master elements [start, stop),
        read from disk, nothing written."""
        self.files.settled(i)
        for seg in self.segments[i]:
            if seg.stop <= start or seg.start >= stop:
                continue
            slot = self._take()
            try:
                self._read(i, seg, slot, None).result()
                window = self._layout(i, seg, slot)
                self._bind(i, window)
                try:
                    see(window)
                finally:
                    self._bind(i, None)
            finally:
                self._give(slot)

    def flush(self) -> None:
        self.files.flush()

    # ---- the image ring ------------------------------------------------------------------------

    def image(self, i: int, next_ones: Sequence[int],
              ready: Callable[[int], bool]) -> torch.Tensor:
        """The pinned buffer holding sub-model i's current image (read now unless a read ahead
        has it), after starting reads ahead of the images of `next_ones` whose weights are
        final (`ready`: their update is done, so its write is issued before the read)."""
        slot = self._ring_read(i, wait=True)
        assert slot is not None
        for j in next_ones:
            if self.on_disk(j) and self.regions[j][0].name == "image" and ready(j):
                self._ring_read(j, wait=False, keep=slot)
        self._ring[slot][2].result()
        region = self.regions[i][0]
        return self.ring[slot][:region.nbytes].view(region.dtype)

    def released(self, i: int, event: Any) -> None:
        """The copy out of sub-model i's ring slot was issued; `event` (CUDA) says when it is
        done, None that it is."""
        for s, held in enumerate(self._ring):
            if held is not None and held[0] == i:
                self._ring_busy[s] = event

    def _ring_read(self, i: int, wait: bool, keep: int | None = None) -> int | None:
        """The ring slot with sub-model i's current image, reading it into a free slot (or the
        one used longest ago but `keep`, once its copy to the GPU is done); None when `wait` is
        False and that copy is still running."""
        self._clock += 1
        with self._lock:
            for s, held in enumerate(self._ring):
                if held is not None and held[0] == i and held[1] == self.version[i]:
                    self._ages[s] = self._clock
                    return s
        free = [s for s, held in enumerate(self._ring) if held is None]
        slot = free[0] if free else min((s for s in range(len(self._ring)) if s != keep),
                                        key=self._ages.__getitem__)
        busy = self._ring_busy[slot]
        if busy is not None:
            if not wait and not busy.query():
                return None
            busy.synchronize()
            self._ring_busy[slot] = None
        region = self.regions[i][0]
        with self._lock:  # the version and the read together (see rewrite)
            read = self.files.read(i, self.ring[slot], region.offset, aligned(region.nbytes))
            self._ring[slot] = (i, self.version[i], read)
        self._ages[slot] = self._clock
        return slot


def _positions(seg: Segment) -> list[int]:
    out, pos = [], 0
    for _, lo, hi, _ in seg.spans:
        out.append(pos)
        pos += aligned(hi - lo)
    return out


__all__ = [
    "DISK_KINDS",
    "DiskTier",
    "Region",
    "Segment",
    "Window",
    "record_regions",
    "record_size",
    "segments",
    "update_chunks",
]
