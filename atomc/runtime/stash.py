"""Runtime, activation stash: boundary values kept in host memory between forward and backward.

With offload_activations (activations="recompute"), a boundary value whose last forward
reader is done goes to host memory (offload stream) and comes back when its first backward
reader's backward starts (prefetch stream), so device memory does not hold every
micro-batch's checkpoints through the forward. The host buffers are reused every step; after
the first step (or one whose shapes changed) they are views into one arena, pinned on CUDA
(`atomc.runtime.pinned.HostBuffers`).

CUDA: the copies run on the executor's streams, ordered with events; tensors that cross
streams are marked with record_stream. CPU: the same code with no streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from atomc.runtime.hostcopies import HostCopies
from atomc.runtime.pinned import HostArena


@dataclass
class Stashed:
    """A boundary value moved to host memory between its forward and backward uses."""

    host: torch.Tensor
    ready: Any  # CUDA event after the device-to-host copy (None on the CPU)


class ActivationStash(HostCopies):
    """The host buffers of stashed boundary values (by value and micro-batch), their arena,
    and the copies both ways."""

    def stash(self, envs: list[dict[str, Any]], names: list[str], after: int) -> None:
        """Move boundary values to host memory until their backward readers need them."""
        tensors = [(n, m) for n in names for m in range(len(envs))
                   if isinstance(envs[m].get(n), torch.Tensor)]
        if not tensors:
            return
        nbytes = sum(envs[m][n].numel() * envs[m][n].element_size() for n, m in tensors)
        if self.cuda:
            os_ = self.offload_stream
            os_.wait_stream(self.compute_stream)
            with torch.cuda.stream(os_), \
                    self.tracer.span("offload", after, "checkpoint_out", os_, nbytes):
                for n, m in tensors:
                    t = envs[m][n]
                    host = self.buffers.buffer((n, m), t)
                    host.copy_(t, non_blocking=True)
                    t.record_stream(os_)  # freed on the compute stream's side below
            ready = torch.cuda.Event()
            ready.record(os_)
        else:
            ready = None
            with self.tracer.span("offload", after, "checkpoint_out", None, nbytes):
                for n, m in tensors:
                    self.buffers.buffer((n, m), envs[m][n]).copy_(envs[m][n])
        for n, m in tensors:
            envs[m][n] = Stashed(self.host[(n, m)], ready)

    @property
    def host(self) -> dict[tuple[str, int], torch.Tensor]:
        return self.buffers.host

    @property
    def arena(self) -> HostArena | None:
        return self.buffers.arena

    def end_step(self) -> None:
        self.buffers.end_step()

    def pinned_bytes(self) -> int:
        """Pinned host memory of the stash (0 before the first offloading step)."""
        return self.buffers.pinned_bytes()

    def unstash(self, envs: list[dict[str, Any]], i: int, names: tuple[str, ...]) -> None:
        """Issue the copies of sub-model i's stashed inputs `names` back to the device, one per
        micro-batch.

        Issued on the prefetch stream when i's backward starts, before the load of P_{i-1}, so
        micro-batch m's inputs arrive while micro-batch m-1 computes (the order the simulator
        assumes); `inputs_ready(i, m)` makes the compute stream wait for micro-batch m's.
        """
        for m, env in enumerate(envs):
            todo = [n for n in names if isinstance(env.get(n), Stashed)]
            if not todo:
                continue
            nbytes = sum(env[n].host.numel() * env[n].host.element_size() for n in todo)
            if self.cuda:
                ps = self.prefetch_stream
                for ev in {id(env[n].ready): env[n].ready for n in todo}.values():
                    ps.wait_event(ev)  # the copy to the host is done
                back = []
                with torch.cuda.stream(ps), \
                        self.tracer.span("prefetch", i, "checkpoint", ps, nbytes):
                    for n in todo:
                        host = env[n].host
                        dev = torch.empty_like(host, device=self.device)  # its layout too
                        dev.copy_(host, non_blocking=True)
                        back.append(dev)
                ready = torch.cuda.Event()
                ready.record(ps)
                self._back_ready[(i, m)] = ready
                for n, dev in zip(todo, back):
                    # allocated on the prefetch stream, read on the compute stream
                    dev.record_stream(self.compute_stream)
                    env[n] = dev
            else:
                with self.tracer.span("prefetch", i, "checkpoint", None, nbytes):
                    for n in todo:
                        env[n] = env[n].host.clone()  # a dense buffer's clone keeps its strides

    def inputs_ready(self, i: int, m: int) -> None:
        """Make the compute stream wait for micro-batch m's inputs of sub-model i (CUDA)."""
        ready = self._back_ready.pop((i, m), None)
        if ready is not None:
            self.compute_stream.wait_event(ready)
