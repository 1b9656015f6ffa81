"""Runtime, pinned host memory: host buffers that are views into ONE allocation.

Each kind of buffer (the images, the gradient buffers, the activation stash, the operator
outputs sent to the host) is one `HostArena`, page-locked where it lies (cudaHostRegister):
one registration per kind, and none of the power-of-two rounding PyTorch's pinned allocator
(pin_memory=True) puts on every allocation, up to twice the bytes. The arenas are allocated
once and reused every step; `HostBuffers` holds buffers whose shapes only a step shows and
puts them into one arena once it has seen them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from atomc.partition.hostmem import ARENA_ALIGN


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
