"""Runtime stage, swap executor: one training step of the ATOM schedule (paper Fig. 12).

Input: the sub-models of a generated package, the host store, the CPU optimizer and C
micro-batches. Output: the mean loss; gradients handed to the optimizer as they come back.

Schedule of one step with k sub-models P_0..P_{k-1}:

  forward   P_0 .. P_{k-2}, each over all C micro-batches; the load of P_{i+1} is issued when
            P_i starts (on the prefetch stream), so it overlaps P_i's compute;
  P_{k-1}   stays resident into the backward: for each micro-batch, forward, loss, backward;
  backward  P_{k-2} .. P_0, each over all C micro-batches, recomputing its internals from its
            saved boundary inputs (activations="recompute") or using the autograd graphs kept
            from the forward (activations="keep"); the load of P_{i-1} is issued when P_i's
            backward starts; P_i's gradients go back to the host in one copy (offload stream)
            as soon as its backward ends, and the CPU optimizer takes them from there;
  next step P_0 is still in its slot; it is refreshed with its updated weights (one copy).

Device memory holds two weight slots (and two gradient slots); sub-model i always uses slot
i % 2, so at most two sub-models' weights are on the device at once, and a sub-model still in
its slot with unchanged weights is not loaded again (P_{k-1} and P_{k-2} into the backward,
P_0 into the next step when its weights did not change).

CUDA: a compute stream, a prefetch stream (host to device) and an offload stream (device to
host), ordered with events only; tensors that cross streams are marked with record_stream.
CPU (`device="cpu"`): the same code with no streams; a "load" is a copy from the host image
into the slot buffer, as on the GPU.

The step is a list of actions (atomc.actions; ATOM's order by default): `run_actions` hands
it to atomc.runtime.interpret, which drives the slots through `use`, `prefetch`, `release`,
`zero_grads`, `grads_to_host` and the optimizer; a layout's swapped stage runs its own list
(with sends and receives) through the same code. The RNG rule is atomc.runtime.rng's.

Parts the executor holds, one each: `WeightSlots` (atomc.runtime.slots: the slot buffers and
what they hold), `ActivationStash` (atomc.runtime.stash: boundary values in host memory) and
`TiedGrads` (atomc.runtime.ties: tied_grads="exact"). The executor owns the streams and the
order of the work on them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from atomc.actions import Action, atom_order
from atomc.runtime.interpret import StepResult, _Step
from atomc.runtime.optim import CpuOptimizer
from atomc.runtime.package import SwapPackage
from atomc.runtime.rng import StepRng
from atomc.runtime.slots import WeightSlots
from atomc.runtime.stash import ActivationStash, Stashed
from atomc.runtime.store import HostStore, SubLayout
from atomc.runtime.ties import TiedGrads
from atomc.runtime.trace import StepTrace, Tracer

# ---------------------------------------------------------------------------------------------
# helpers


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
            if grads is not None:
                new.grad = grads[name]
            new_of[id(p)] = new
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, new_of[id(p)])


# ---------------------------------------------------------------------------------------------
# executor


class SwapExecutor:
    """Runs training steps of a generated package on one device (see the module docstring).

    Owns the streams, the device sub-models, and the order of loads, compute and copies; holds
    the weight slots (`slots`), the activation stash (`stash`) and the exact ties (`ties`).
    """

    def __init__(self, package: SwapPackage, store: HostStore, optimizer: CpuOptimizer,
                 host_buffers: list[dict[str, torch.Tensor]], *, device: torch.device, accum: int,
                 activations: str, offload_activations: bool, autocast_dtype: torch.dtype | None,
                 loss_fn: Callable[[Any, tuple], torch.Tensor], seed: int, tracer: Tracer,
                 tied_grads: str = "fast", holds_output: bool = True,
                 recv_names: tuple[str, ...] = (), send_names: tuple[str, ...] = (),
                 early_prefetch: bool = False):
        self.pkg = package
        self.store = store
        self.opt = optimizer
        self.device = device
        self.cuda = device.type == "cuda"
        self.accum = accum
        self.keep = activations == "keep"
        self.offload_activations = offload_activations
        self.autocast_dtype = autocast_dtype
        self.loss_fn = loss_fn
        self.seed = seed
        self.tracer = tracer
        self.k = package.num_submodels
        self.layouts: list[SubLayout] = store.layouts
        self.readers = package.readers()
        self.producer = package.producers()
        # a pipeline stage whose range ends before the model's output ends on received
        # gradients, not a loss; what it receives carries gradients back like its own values
        self.holds_output = holds_output
        self.recv_names = recv_names
        self.send_names = send_names
        self.grad_inputs = {n for n, p in self.producer.items() if p >= 0} | set(recv_names)
        self.early_prefetch = early_prefetch and self.k > 1

        self.slots = WeightSlots(self.layouts, store.load_deps, store.transfer_dtype, device)
        self.modules = self._bind_modules(host_buffers)

        if self.cuda:
            self.compute_stream = torch.cuda.Stream(device)
            self.prefetch_stream = torch.cuda.Stream(device)
            self.offload_stream = torch.cuda.Stream(device)
            torch.cuda.current_stream(device).synchronize()  # slot allocation and buffers: once
        else:
            self.compute_stream = self.prefetch_stream = self.offload_stream = None
        self.stash = ActivationStash(device, tracer, self.compute_stream, self.prefetch_stream,
                                     self.offload_stream)
        self._has_buffers = [any(True for _ in m.buffers()) for m in self.modules]
        self.ties = TiedGrads(self.modules, self.layouts, exact=tied_grads == "exact")
        if tied_grads == "exact":  # summed on the device: the store leaves them out of its sums
            store.exact_keys = set(self.ties.ties)
        self._loss_host = torch.zeros((), dtype=torch.float64, pin_memory=self.cuda)
        self._loss_ready: Any = None

    # ---- set-up --------------------------------------------------------------------------------

    def _bind_modules(self, host_buffers: list[dict[str, torch.Tensor]]) -> list[nn.Module]:
        """Device sub-models whose parameters are views of their slot's flat buffers."""
        modules = self.pkg.build_submodels(device="meta")  # no weights: they are slot views
        for i, mod in enumerate(modules):
            params, grads = self.slots.views(i)
            rebind_parameters(mod, params, requires_grad=True, grads=grads)
            for name, buf in host_buffers[i].items():
                owner, _, leaf = name.rpartition(".")
                sub = mod.get_submodule(owner) if owner else mod
                sub._buffers[leaf] = buf.to(self.device, copy=True)
            mod.train()
        return modules

    def synchronize(self) -> None:
        """Wait for everything queued on this executor's streams (not for steady-state use)."""
        if self.cuda:
            for st in (self.compute_stream, self.prefetch_stream, self.offload_stream):
                st.synchronize()

    def _buffer_slots(self, i: int) -> tuple[list[nn.Module], list[str], list[torch.Tensor]]:
        owners, names, tensors = [], [], []
        for module in self.modules[i].modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    owners.append(module)
                    names.append(name)
                    tensors.append(buf)
        return owners, names, tensors

    @contextmanager
    def _buffers_as_in_forward(self, i: int, saved: list[torch.Tensor] | None) -> Iterator[None]:
        """Recompute with the buffers as they were before this micro-batch's forward.

        A module that updates a buffer (running statistics) would otherwise update it a second
        time, and one that reads a buffer would see the later value; the recomputation runs on
        copies of the values saved before the forward, and the real buffers stay as they are.
        """
        if saved is None:
            yield
            return
        owners, names, tensors = self._buffer_slots(i)
        for owner, name, value in zip(owners, names, saved):
            owner._buffers[name] = value
        try:
            yield
        finally:
            for owner, name, value in zip(owners, names, tensors):
                owner._buffers[name] = value

    def invalidate_slots(self) -> None:
        """Forget what the slots hold (the weights were replaced): every sub-model loads again."""
        self.slots.invalidate()

    # ---- loads ---------------------------------------------------------------------------------

    def _load(self, i: int, wait: bool = True) -> bool:
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
        nbytes = n * self.store.image[i].element_size()
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
                slots.params[s].data[:n].copy_(self.store.image[i], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(ps)
            slots.loaded[s] = ev
        else:
            with self.tracer.span("prefetch", i, kind, None, nbytes, s):
                slots.params[s].data[:n].copy_(self.store.image[i])
        slots.loaded_now(i)
        return True

    def use(self, i: int) -> None:
        """Before computing sub-model i: have its current weights in its slot (load them when the
        slot holds anything else, waiting for a pending optimizer update of them first).

        Stream contract (CUDA): the compute stream waits for the load; the caller then issues
        every computation that reads sub-model i's weights (or writes its gradients) on the
        compute stream (inside `compute()`), and calls `release(i)` after the last of them.
        """
        self._load(i)
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

    # ---- public API: driving the slots from outside run_step ----------------------------------
    #
    # The interpreter (atomc.runtime.interpret) drives the slots with these methods and `use`,
    # `release`, `zero_grads`; the stream contract, in the order of a step:
    #
    #   with ex.compute():                  # the compute stream, ordered after the caller's
    #       ex.adopt(x)                      # x made on the caller's stream, freed in here
    #       ex.use(i); ex.prefetch(i + 1)    # weights in the slot; the next load overlaps
    #       ... ex.module(i)(...) ...        # forward / backward on the compute stream
    #       ex.release(i)                    # loads into this slot wait for that compute
    #       ev = ex.grads_to_host(i)         # after a backward: gradients to store.grad[i]
    #   ex.update_submodel(i, step)          # after ev: AdamW on i, fresh images, reload next use
    #
    # On the CPU (device="cpu") there are no streams or events: every method acts at once.

    def compute(self) -> Any:
        """Context: run the block on the compute stream, after everything the caller's current
        stream did before it (values it made: received tensors, batches), and make the caller's
        stream wait for the block's work after it (before it hands results on). A no-op on CPU."""
        return self._compute_ctx() if self.cuda else nullcontext()

    @contextmanager
    def _compute_ctx(self) -> Iterator[None]:
        caller = torch.cuda.current_stream(self.device)
        self.compute_stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.compute_stream):
                yield
        finally:
            caller.wait_stream(self.compute_stream)

    def adopt(self, value: Any) -> Any:
        """Mark a device tensor made on another stream (the caller's: a received value, a batch)
        as read on the compute stream, so that the caching allocator does not hand its memory
        out again, once it is freed, before the compute stream's uses of it are done. Returns
        `value`; anything but a CUDA tensor is left as it is."""
        if self.cuda and isinstance(value, torch.Tensor) and value.is_cuda:
            value.record_stream(self.compute_stream)
        return value

    def module(self, i: int) -> nn.Module:
        """The device sub-model i: its parameters are views of its slot (valid between use(i) and
        release(i)), its buffers its own device tensors."""
        return self.modules[i]

    def prefetch(self, i: int) -> bool:
        """Issue the load of sub-model i into its slot on the prefetch stream, after the last
        compute released that slot (asynchronous; use(i) waits for it). Returns False, loading
        nothing, when an optimizer update of its weights is still running."""
        return self._load(i, wait=False)

    def grads_to_host(self, i: int) -> Any:
        """Copy sub-model i's gradient slot into the host store (store.grad[i]), after the compute
        issued so far (call it after release(i), on the caller's thread). CUDA: on the offload
        stream; returns the event after which the host copy is complete (synchronize it before the
        host reads store.grad[i]); zero_grads of that slot waits for it too. CPU: done, None."""
        s = self.slots.slot(i)
        grads = self.slots.grads[s][:self.layouts[i].numel]
        host = self.store.grad[i]
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

    def wait_loads(self) -> None:
        """Block the host until every weight load issued so far has finished reading its host
        image, so that the images may be rewritten (refresh_images). One prefetch stream issues
        all loads in order, so the newest load event of each slot covers the older ones."""
        if self.cuda:
            for ev in self.slots.loaded:
                if ev is not None:
                    ev.synchronize()

    def update_submodel(self, i: int, step: int) -> None:
        """AdamW on sub-model i's masters now, on the calling thread, with the gradients as they
        are in store.grad_master[i] (the caller gathered, reduced and clipped them; they must be
        on the host: synchronize grads_to_host's event first), at step `step`'s learning rate;
        then fresh images of its weights (after wait_loads: no load still reads them), and every
        slot whose content depends on them loads again before its next use."""
        self.wait_loads()
        opt = self.opt.optims[i]
        if opt is not None:
            self.opt.config.set_lr(opt, step)
            opt.step()
        self.store.refresh_images(i)
        self.slots.bump(i)

    def pinned_bytes(self) -> int:
        """Pinned host memory of the activation stash (0 before the first offloading step)."""
        return self.stash.pinned_bytes()

    # ---- the step ----------------------------------------------------------------------------

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _stream(self) -> Any:
        return torch.cuda.stream(self.compute_stream) if self.cuda else nullcontext()

    def run_step(self, micro_batches: list[tuple], step: int,
                 actions: list[Action] | None = None) -> tuple[float, StepTrace | None]:
        """One training step of the whole package: `actions` (ATOM's order by default) over
        the micro-batches; returns the mean loss and, when tracing, the step's trace."""
        t_start = time.perf_counter()
        C = len(micro_batches)
        if actions is None:
            actions = atom_order(self.k, C, early_prefetch=self.early_prefetch)
        self.tracer.begin_step(step, self.compute_stream)
        scale = self.opt.begin_step(step)
        rng = StepRng(self.device, self.seed, step, C)
        try:
            result = self.run_actions(actions, micro_batches, step, rng, scale)
        finally:
            rng.restore()
        if self.cuda:
            self._loss_ready.synchronize()  # this step's loss: one event, not the device
            loss = float(self._loss_host) / C
        else:
            loss = float(result.loss_sum) / C
        trace = self.tracer.end_step((time.perf_counter() - t_start) * 1e3)
        return loss, trace

    def run_actions(self, actions: list[Action], micro_batches: list[tuple], step: int,
                    rng: StepRng, scale: float = 1.0, io: Any = None) -> StepResult:
        """Execute a list of actions (atomc.actions) on the compute stream: F, B, L, O, U of
        this executor's sub-models, and S, R through `io` (a pipeline stage's links: `recv`,
        `send`, `recv_grads`, `send_grads`, each per micro-batch; see `StageIO`).

        The caller's stream: the compute stream waits for what it made before (the batch,
        received values), and it waits for the compute stream before anything is sent.
        """
        caller = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            self.compute_stream.wait_stream(caller)
        st = _Step(self, actions, micro_batches, step, rng, scale, io, caller)
        with self._stream():
            st.run()
        self.stash.end_step()
        return st.result()

    def _to_device(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.device == self.device:
            if self.cuda:
                # Made by the caller on its stream (run_step's compute stream waits for it) and
                # read on the compute stream until P_0's backward, which is still queued when
                # run_step returns: the caller freeing it must not let its memory be reused before.
                t.record_stream(self.compute_stream)
            return t
        if t.device.type != "cpu":
            return t.to(self.device, non_blocking=True)
        if self.cuda:
            src = t if t.is_pinned() else t.pin_memory()
            return src.to(self.device, non_blocking=True)  # on the compute stream
        return t

    def _value(self, env: dict[str, Any], name: str) -> Any:
        v = env[name]
        if isinstance(v, Stashed):  # pragma: no cover - unstash runs before every backward
            raise AssertionError(f"value {name} used while stashed on the host")
        return v

    def _collect_input_grads(self, grads: dict[str, torch.Tensor], i: int,
                             args: list[Any]) -> None:
        for n, a in zip(self.pkg.inputs[i], args):
            if n not in self.grad_inputs or not isinstance(a, torch.Tensor) or a.grad is None:
                continue
            grads[n] = a.grad if n not in grads else grads[n] + a.grad

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
        self.slots.grads[self.slots.slot(i)][:self.layouts[i].numel].zero_()

    def _free_after_forward(self, envs: list[dict[str, Any]], i: int) -> None:
        """Drop or stash values whose last forward reader was sub-model i."""
        done = [n for n, rs in self.readers.items() if rs[-1] == i]
        if self.keep:  # the autograd graphs hold what the backward needs
            for env in envs:
                for n in done:
                    env.pop(n, None)
        elif self.offload_activations:
            self.stash.stash(envs, done, i)

    def _free_after_backward(self, envs: list[dict[str, Any]], i: int) -> None:
        """Drop values whose first reader was sub-model i: no backward needs them any more."""
        done = [n for n, rs in self.readers.items() if rs[0] == i]
        for env in envs:
            for n in done:
                env.pop(n, None)
