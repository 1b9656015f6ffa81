"""DiLoCo's rounds for one peer: pseudo-gradients averaged, one fragment a round, and the outer
step applied to the swap trainer's master weights.

input:  a swap trainer (atomc.runtime.SwapTrainer), the outer options (outer.OuterConfig), the
        fragments (outer.fragments_of) and an averager for the rounds (hivemind's
        DecentralizedAverager over `tensors()`, compressed with `compression()`)
output: at each round's boundary the fragment's pseudo-gradient (its weights at the round's
        start minus its weights now) is averaged with the peers that are ready, the outer
        optimizer steps the start weights with the average, and the trainer's masters of that
        fragment become the new start weights; a `RoundInfo` per round (group, bytes, times)

One fragment (K = 1): the round runs when the local steps reach the boundary and the peer waits
for it (DiLoCo). K fragments (Streaming DiLoCo): the round of fragment f starts at a boundary
and runs in the background while the next H/K local steps go on; it is applied at the next
boundary (the peer waits there only for what the steps did not hide). The local steps taken
while it ran are kept: the fragment's masters become the new start weights plus what those
steps changed, so every local step is in exactly one pseudo-gradient.

A round with no group (every other peer gone, or none ready in time) applies the outer step to
this peer's own pseudo-gradient, as DiLoCo with one worker does; hivemind retries a round whose
member dies within the round's timeout, so the others lose no round.

Persistent buffers (running statistics) of the fragment's sub-models are averaged beside it, as
they are, exact (ATOM's rule for them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from atomc.distributed.outer import DiskOuterOptimizer, OuterConfig, OuterOptimizer
from atomc.distributed.rounds import (
    DTYPE_BYTES,
    compression_for,
    round_bytes,
    tensor_dtype,
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- the trainer's weights, by fragment ------------------------------------------------------


def master_sizes(trainer: Any) -> list[int]:
    """Master values of each sub-model (the host store's owned weights)."""
    return [L.owned_numel for L in trainer.store.layouts]


def outer_on_disk(trainer: Any) -> bool:
    """Whether the trainer's plan puts masters on the offload drives (the outer state, as large
    as they are or twice, goes there too)."""
    return any("masters" in kinds for kinds in trainer.store.disk_kinds)


def read_fragment(trainer: Any, fragment: list[int]) -> torch.Tensor:
    """A copy of the fragment's masters, one flat vector, once the pending updates are in."""
    trainer.wait()
    store = trainer.store
    return torch.cat([store.read_master(i).detach().reshape(-1).clone() for i in fragment])


def write_fragment(trainer: Any, fragment: list[int], flat: torch.Tensor) -> None:
    """Set the fragment's masters to `flat` and bring their device images along: what
    SwapTrainer.load_state_dict does for the masters it is given, the optimizer state kept."""
    trainer.wait()
    store = trainer.store
    off = 0
    with torch.no_grad():
        for i in fragment:
            n = store.layouts[i].owned_numel
            store.write_master(i, flat[off:off + n])
            off += n
        for i in fragment:  # its own images and every replica of its weights elsewhere
            store.refresh_images(i)
    trainer.executor.invalidate_slots()


def fragment_widths(trainer: Any, fragments: list[list[int]]) -> tuple[int, int]:
    """Values of the largest fragment's masters and of its persistent buffers: the sizes of
    the round's tensors."""
    sizes = master_sizes(trainer)
    buffers = trainer.persistent_buffers()
    return (max(sum(sizes[i] for i in fr) for fr in fragments),
            max(sum(b.numel() for i, _, b in buffers if i in set(fr)) for fr in fragments))


def fragment_buffers(trainer: Any, fragment: list[int]) -> list[tuple[int, str, torch.Tensor]]:
    chosen = set(fragment)
    return [b for b in trainer.persistent_buffers() if b[0] in chosen]


def read_buffers(buffers: list[tuple[int, str, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    if not buffers:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([b.detach().reshape(-1).to(dtype) for _, _, b in buffers])


def write_buffers(trainer: Any, buffers: list[tuple[int, str, torch.Tensor]],
                  flat: torch.Tensor) -> None:
    """Averaged buffers into the host and device modules; counters take the rounded average."""
    off = 0
    with torch.no_grad():
        for i, name, b in buffers:
            value = flat[off:off + b.numel()].view_as(b)
            value = (value if b.is_floating_point() else value.round()).to(b.dtype)
            off += b.numel()
            b.copy_(value)
            dict(trainer.executor.modules[i].named_buffers())[name].copy_(value)


# ---- rounds ----------------------------------------------------------------------------------


@dataclass
class RoundInfo:
    """One round as this peer saw it."""

    epoch: int
    fragment: int
    members: dict[str, int] = field(default_factory=dict)  # name -> epoch ({}: no group)
    place: int = -1  # in hivemind's group order
    sent_bytes: int = 0
    received_bytes: int = 0
    group_wait_s: float = 0.0  # asked for a group -> the all-reduce began (blocking rounds)
    allreduce_s: float = 0.0  # the all-reduce (blocking), or the whole round (in the background)
    exposed_s: float = 0.0  # what the peer waited for the round at its boundary
    weight: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.members)


@dataclass
class _Pending:
    info: RoundInfo
    control: Any  # hivemind's StepControl
    delta: torch.Tensor  # this peer's pseudo-gradient (own fragment size)
    buffers_now: torch.Tensor
    launch_weights: torch.Tensor | None  # fragment weights at launch (K > 1: the carry)
    t_launch: float
    deadline: float


class OuterRounds:
    """This peer's DiLoCo rounds (see the module docstring). `averager` is set by the peer
    once made over `tensors()` with `compression()`."""

    def __init__(self, trainer: Any, cfg: OuterConfig, fragments: list[list[int]], *,
                 name: str, log: Callable[[str], None] = print):
        self.trainer = trainer
        self.cfg = cfg
        self.fragments = fragments
        self.name = name
        self.log = log
        sizes = master_sizes(trainer)
        self.sizes = [sum(sizes[i] for i in fr) for fr in fragments]
        self.master_dtype = trainer.store.master_dtype
        self.dtype = getattr(torch, tensor_dtype(cfg.round_dtype, _dtype_name(self.master_dtype)))
        self.buffer_sizes = [sum(b.numel() for _, _, b in fragment_buffers(trainer, fr))
                             for fr in fragments]
        self.width = max(self.sizes)
        self.buffer_width = max(self.buffer_sizes)
        starts = [read_fragment(trainer, fr) for fr in fragments]
        # beside the masters: on the offload drives where the plan put them there
        self.outer = (DiskOuterOptimizer(starts, cfg, trainer.store.drives)
                      if outer_on_disk(trainer) else OuterOptimizer(starts, cfg))
        self.averager: Any = None
        self.pending: _Pending | None = None

    # ---- what the round averager holds ------------------------------------------------------

    def tensors(self) -> list[torch.Tensor]:
        """The round's tensors: the largest fragment's pseudo-gradient (smaller ones padded
        with zeros) and, when the model has persistent buffers, the largest fragment's."""
        out = [torch.zeros(self.width, dtype=self.dtype)]
        if self.buffer_width:
            out.append(torch.zeros(self.buffer_width, dtype=self.master_dtype))
        return out

    def compression(self) -> Any:
        """The pseudo-gradient in the round dtype, the buffers exact."""
        main = compression_for(self.cfg.round_dtype)
        if not self.buffer_width:
            return main
        from hivemind.compression import NoCompression, PerTensorCompression

        return PerTensorCompression([main, NoCompression()])

    def wire_tensors(self) -> list[tuple[int, str | None, int]]:
        """(values, round dtype, bytes a value) of `tensors()`, for rounds.round_bytes."""
        out = [(self.width, self.cfg.round_dtype, self.dtype.itemsize)]
        if self.buffer_width:
            out.append((self.buffer_width, None, DTYPE_BYTES[_dtype_name(self.master_dtype)]))
        return out

    def fragment_at(self, epoch: int) -> int:
        return epoch % len(self.fragments)

    # ---- a round ----------------------------------------------------------------------------

    def launch(self, epoch: int, weight: float, timeout_s: float) -> None:
        """Start round `epoch` (its fragment's pseudo-gradient into the averager, a group
        looked for in the background)."""
        f = self.fragment_at(epoch)
        fr = self.fragments[f]
        now = read_fragment(self.trainer, fr)
        delta = self.outer.pseudo_gradient(f, now)
        buffers = read_buffers(fragment_buffers(self.trainer, fr), self.master_dtype)
        with self.averager.get_tensors() as tensors:
            tensors[0].zero_()
            tensors[0][:delta.numel()].copy_(delta)
            if len(tensors) > 1:
                tensors[1].zero_()
                tensors[1][:buffers.numel()].copy_(buffers)
        t0 = time.monotonic()
        control = self.averager.step(weight=weight, gather={"name": self.name, "epoch": epoch},
                                     timeout=timeout_s, allow_retries=True, wait=False)
        keep = now if self.cfg.fragments > 1 else None
        self.pending = _Pending(RoundInfo(epoch=epoch, fragment=f, weight=weight), control,
                                delta, buffers, keep, t0, t0 + timeout_s + 5.0)

    def complete(self) -> RoundInfo | None:
        """Wait for the round in flight (bounded by its timeout), average in what it gives and
        take the outer step; None when no round is in flight."""
        p = self.pending
        if p is None:
            return None
        self.pending = None
        info = p.info
        t_wait = time.monotonic()
        group, started = self._wait(p)
        info.exposed_s = time.monotonic() - t_wait
        done = time.monotonic()
        if started is not None and self.cfg.fragments == 1:
            info.group_wait_s = started - p.t_launch
            info.allreduce_s = done - started
        else:
            info.allreduce_s = done - p.t_launch
        f, fr = info.fragment, self.fragments[info.fragment]
        n, nb = self.sizes[f], self.buffer_sizes[f]
        if group:
            with self.averager.get_tensors() as tensors:
                averaged = tensors[0][:n].to(self.master_dtype)
                buffers = tensors[1][:nb].clone() if len(tensors) > 1 else p.buffers_now
            names = [v.get("name") if isinstance(v, dict) else None for v in group.values()]
            info.members = {str(v["name"]): int(v["epoch"]) for v in group.values()
                            if isinstance(v, dict)}
            info.place = names.index(self.name) if self.name in names else -1
            if info.place >= 0:
                info.sent_bytes, info.received_bytes = round_bytes(
                    self.wire_tensors(), len(group), info.place)
        else:  # no group: one worker's outer step on its own pseudo-gradient
            averaged, buffers = p.delta, p.buffers_now
        new = self.outer.step(f, averaged)
        if p.launch_weights is not None:  # keep what the local steps did while it ran
            new = new + (read_fragment(self.trainer, fr) - p.launch_weights)
        write_fragment(self.trainer, fr, new)
        if nb:
            write_buffers(self.trainer, fragment_buffers(self.trainer, fr), buffers)
        return info

    def _wait(self, p: _Pending) -> tuple[dict | None, float | None]:
        """The round's group (None: it failed or found none) and when its all-reduce began."""
        from hivemind.averaging.control import AveragingStage

        started = None
        while not p.control.done():
            if started is None and p.control.stage == AveragingStage.RUNNING_ALLREDUCE:
                started = time.monotonic()
            if time.monotonic() > p.deadline:
                p.control.cancel()
                self.log(f"round {p.info.epoch}: no result within its timeout; cancelled")
                return None, started
            time.sleep(0.002)
        try:
            group = p.control.result()
        except Exception as e:  # noqa: BLE001 - a groupmate died or no group formed: go alone
            self.log(f"round {p.info.epoch}: averaging failed ({type(e).__name__}: {e})")
            return None, started
        return group or None, started

    # ---- state for joining peers -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.outer.state_dict()

    def load_state_dict(self, state: dict[str, Any], source: str) -> None:
        self.outer.load_state_dict(state, source)

    def close(self) -> None:
        self.outer.close()


__all__ = ["OuterRounds", "RoundInfo", "fragment_buffers", "fragment_widths", "master_sizes",
           "outer_on_disk", "read_buffers", "read_fragment", "write_buffers", "write_fragment"]
