"""Runtime, the executor's transfers: weight loads into the device slots and gradient copies to
the host store, on the executor's CUDA streams, ordered with its compute by events
(`Transfers`).

Stream contract (CUDA): a list runs on the compute stream (the executor's `session`), which
first waits for what the caller's stream did (the batch, received values); loads run on the
prefetch stream, each after the compute that last read its slot (`release` records that), and
the compute waits for a load before its sub-model computes (`use`); gradient copies run on the
offload stream after the backward, and the slot's next zeroing waits for them. S and R run on
the caller's stream, ordered with the compute by the executor's `exchange`. On the CPU there
are no streams or events: every method acts at once.
"""

from __future__ import annotations

from typing import Any

import torch

from atomc.runtime.cpuoptimizer import CpuOptimizer
from atomc.runtime.hostcopies import CopyLanes
from atomc.runtime.slots import WeightSlots
from atomc.runtime.store import HostStore


class Transfers:
    """The copies between the host and the device slots of one executor: loads of weights on the
    prefetch stream, gradient copies on the offload stream, each ordered with the compute
    stream by events; on the CPU each copy is done when it returns."""

    def __init__(self, lanes: CopyLanes, slots: WeightSlots, store: HostStore,
                 optimizer: CpuOptimizer):
        self.device = lanes.device
        self.cuda = lanes.device.type == "cuda"
        self.tracer = lanes.tracer
        self.compute_stream = lanes.compute
        self.prefetch_stream = lanes.prefetch
        self.offload_stream = lanes.offload
        self.slots = slots
        self.store = store
        self.opt = optimizer
        self.layouts = store.layouts
        self._last_load = 0  # the direction loads go in: the disk tier reads images ahead

    def to_device(self, t: Any) -> Any:
        """A micro-batch's value on the device, copied on the caller's stream where it is not."""
        if not isinstance(t, torch.Tensor):
            return t
        if t.device == self.device:
            if self.cuda:
                # Made by the caller on its stream (the compute stream waits for it) and read
                # on the compute stream until P_0's backward, which is still queued when
                # run_step returns: the caller freeing it must not let its memory be reused before.
                t.record_stream(self.compute_stream)
            return t
        if t.device.type != "cpu":
            return t.to(self.device, non_blocking=True)
        if self.cuda:
            src = t if t.is_pinned() else t.pin_memory()
            return src.to(self.device, non_blocking=True)  # on the caller's stream
        return t

    def adopt(self, value: Any) -> Any:
        """Mark a device tensor made on another stream (the caller's: a received value, a batch)
        as read on the compute stream, so that the caching allocator does not hand its memory
        out again, once it is freed, before the compute stream's uses of it are done. Returns
        `value`; anything but a CUDA tensor is left as it is."""
        if self.cuda and isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(self.compute_stream)
        return value

    def load(self, i: int, wait: bool = True) -> bool:
        """Have sub-model i's current weights in slot i % 2 (issued, not necessarily done).

        With wait=False, returns False instead of waiting for a pending optimizer update.
        """
        slots = self.slots
        if slots.current(i):
            return True
        deps = self.store.load_deps[i]
        if not wait and not self.opt.updates_done(deps):
            return False
        self.opt.wait_update(deps)
        s = slots.slot(i)
        n = self.layouts[i].numel
        # the image in host memory, or read from disk into the tier's ring (reading the next
        # ones ahead, in the direction the loads go)
        step = 1 if i >= self._last_load else -1
        self._last_load = i
        source = self.store.load_source(i, (i + step, i + 2 * step),
                                        lambda j: self.opt.updates_done(self.store.load_deps[j]))
        nbytes = n * source.element_size()
        # "refresh": the slot holds the same sub-model, with older weights
        kind = "refresh" if slots.resident().get(s) == i else "load"
        # The copy goes through .data, so it does not bump the version counter that the slot
        # shares with the parameter views. With activations="keep", the autograd graph of a
        # sub-model kept from its forward saves those views; a load of another sub-model into
        # the same slot in between would otherwise fail its backward ("modified by an inplace
        # operation"). It stays correct: before sub-model i's backward, use(i) has the slot
        # hold i's weights again, and they are the ones its forward used: its content (its own
        # epoch and those of the owners of its tied replicas) only changes when one of them is
        # updated, and in this step those updates come after i's backward (its own, and owners
        # j < i, whose backward follows i's); the previous step's updates were waited for
        # before the forward's load. So the saved views read the same values again.
        if self.cuda:
            ps = self.prefetch_stream
            if slots.free[s] is not None:
                ps.wait_event(slots.free[s])  # the slot's previous sub-model is done computing
            with torch.cuda.stream(ps), self.tracer.span("prefetch", i, kind, ps, nbytes, s):
                slots.params[s].data[:n].copy_(source, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(ps)
            slots.loaded[s] = ev
            self.store.load_issued(i, ev)
        else:
            with self.tracer.span("prefetch", i, kind, None, nbytes, s):
                slots.params[s].data[:n].copy_(source)
            self.store.load_issued(i, None)
        slots.loaded_now(i)
        return True

    def use(self, i: int) -> None:
        """Before computing sub-model i: its current weights in its slot (loaded when the slot
        holds anything else, after a pending optimizer update of them); the compute stream
        waits for the load."""
        self.load(i)
        loaded = self.slots.loaded[self.slots.slot(i)]
        if self.cuda and loaded is not None:
            self.compute_stream.wait_event(loaded)

    def release(self, i: int) -> None:
        """After the last computation reading sub-model i's slot was issued on the compute
        stream: the next load into that slot (on the prefetch stream) waits for it."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.compute_stream)
            self.slots.free[self.slots.slot(i)] = ev

    def grads_to_host(self, i: int) -> Any:
        """Copy sub-model i's gradient slot into the host store (store.grad(i)), after the
        compute issued so far. CUDA: on the offload stream; returns the event after which the
        host copy is complete; the slot's next zeroing waits for it too. CPU: done, None."""
        s = self.slots.slot(i)
        grads = self.slots.grads[s][:self.layouts[i].grad_numel]
        # a ring's buffer: taken now, given back by the update that consumes it
        host = self.store.grads.acquire(i, lambda held: self.opt.wait_update([held]))
        nbytes = grads.numel() * host.element_size()
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self.compute_stream)
            os_ = self.offload_stream
            os_.wait_event(done)
            with torch.cuda.stream(os_), self.tracer.span("offload", i, "offload", os_, nbytes):
                host.copy_(grads, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(os_)
            self.slots.grad_free[s] = ready
            return ready
        with self.tracer.span("offload", i, "offload", None, nbytes):
            host.copy_(grads)
        return None

    def wait_grad_slot(self, i: int) -> None:
        """Make the compute stream wait until the previous copy of sub-model i's gradient slot
        to the host is done (CUDA; nothing to wait for on the CPU)."""
        s = self.slots.slot(i)
        if self.cuda and self.slots.grad_free[s] is not None:
            self.compute_stream.wait_event(self.slots.grad_free[s])

    def zero_grads(self, i: int) -> None:
        """Zero sub-model i's gradient slot before its backward (on the compute stream, once the
        previous copy of that slot to the host is done)."""
        self.wait_grad_slot(i)
        self.slots.grads[self.slots.slot(i)][:self.layouts[i].grad_numel].zero_()

    def wait_loads(self) -> None:
        """Block the host until every weight load issued so far has finished reading its host
        image, so that the images may be rewritten (refresh_images). One prefetch stream issues
        all loads in order, so the newest load event of each slot covers the older ones."""
        if self.cuda:
            for ev in self.slots.loaded:
                if ev is not None:
                    ev.synchronize()

    def synchronize(self) -> None:
        """Wait for everything queued on this executor's streams (not for steady-state use)."""
        if self.cuda:
            for st in (self.compute_stream, self.prefetch_stream, self.offload_stream):
                st.synchronize()
