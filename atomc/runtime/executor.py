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

Callers that schedule sub-models themselves (the layout runner's swapped stage) drive the slots
through the public methods `compute`, `adopt`, `use`, `prefetch`, `release`, `zero_grads`,
`grads_to_host`, `wait_loads` and `update_submodel`; their docstrings state the stream contract.

RNG rule (dropout): micro-batch m of step s draws from its own generator stream, seeded with
micro_batch_seed(seed, s, m), and consumes it in model order, sub-model after sub-model — the
order in which the unpartitioned model consumes it. The generator state at the start of each
(sub-model, micro-batch) forward is recorded and restored for its recomputation.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from atomc.errors import UsageError
from atomc.runtime.optim import CpuOptimizer
from atomc.runtime.package import SwapPackage
from atomc.runtime.store import HostArena, HostStore, SubLayout
from atomc.runtime.trace import StepTrace, Tracer

# ---------------------------------------------------------------------------------------------
# RNG


def micro_batch_seed(seed: int, step: int, micro_batch: int) -> int:
    """The seed of micro-batch `micro_batch` of step `step` (the same on every device)."""
    digest = hashlib.blake2b(f"atomc:{seed}:{step}:{micro_batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _generators(device: torch.device) -> list[torch.Generator]:
    gens = [torch.default_generator]
    if device.type == "cuda":
        torch.cuda.init()  # default_generators is filled in by CUDA's lazy initialisation
        gens.append(torch.cuda.default_generators[device.index if device.index is not None
                                                  else torch.cuda.current_device()])
    return gens


@contextmanager
def micro_batch_rng(seed: int, step: int, micro_batch: int,
                    device: str | torch.device = "cpu") -> Iterator[None]:
    """Run the block with the CPU (and CUDA) generators seeded for (step, micro_batch).

    This is the rule the swap runtime follows; wrap the plain model's forward (and loss) of
    micro-batch m of step s in it to draw the same dropout masks. The caller's generator
    states are restored on exit.
    """
    gens = _generators(torch.device(device))
    saved = [g.get_state() for g in gens]
    s = micro_batch_seed(seed, step, micro_batch)
    for g in gens:
        g.manual_seed(s)
    try:
        yield
    finally:
        for g, st in zip(gens, saved):
            g.set_state(st)


class _StepRng:
    """Per-micro-batch generator cursors for one step (see the RNG rule above)."""

    def __init__(self, device: torch.device, seed: int, step: int, num_micro: int):
        self.gens = _generators(device)
        self.saved = [g.get_state() for g in self.gens]
        self.cursor: list[list[torch.Tensor]] = []
        for m in range(num_micro):
            s = micro_batch_seed(seed, step, m)
            states = []
            for g in self.gens:
                g.manual_seed(s)
                states.append(g.get_state())
            self.cursor.append(states)

    @contextmanager
    def forward(self, m: int) -> Iterator[list[torch.Tensor]]:
        """Continue micro-batch m's stream; yields the state it started from (for replay)."""
        start = self.cursor[m]
        for g, st in zip(self.gens, start):
            g.set_state(st)
        yield start
        self.cursor[m] = [g.get_state() for g in self.gens]

    @contextmanager
    def replay(self, state: list[torch.Tensor]) -> Iterator[None]:
        for g, st in zip(self.gens, state):
            g.set_state(st)
        yield

    def restore(self) -> None:
        for g, st in zip(self.gens, self.saved):
            g.set_state(st)


# ---------------------------------------------------------------------------------------------
# helpers


def _as_tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _needs_grad(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _leaf(v: Any, grad: bool) -> Any:
    if grad and _needs_grad(v):
        return v.detach().requires_grad_(True)
    return v


@dataclass
class _Stashed:
    """A boundary value moved to host memory between its forward and backward uses."""

    host: torch.Tensor
    ready: Any  # CUDA event after the device-to-host copy (None on the CPU)


def rebind_parameters(module: nn.Module, tensors: dict[str, torch.Tensor], requires_grad: bool,
                      grads: dict[str, torch.Tensor] | None = None) -> None:
    """Make each parameter of `module` a Parameter over the given tensor (a view of a flat buffer).

    A Parameter registered under several names in the module stays one Parameter.
    """
    new_of: dict[int, nn.Parameter] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) not in new_of:
            if name not in tensors:
                raise KeyError(name)
            new = nn.Parameter(tensors[name], requires_grad=requires_grad)
            if grads is not None:
                new.grad = grads[name]
            new_of[id(p)] = new
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, new_of[id(p)])


# ---------------------------------------------------------------------------------------------
# executor


class SwapExecutor:
    """Runs training steps of a generated package on one device (see the module docstring)."""

    def __init__(self, package: SwapPackage, store: HostStore, optimizer: CpuOptimizer,
                 host_buffers: list[dict[str, torch.Tensor]], *, device: torch.device, accum: int,
                 activations: str, offload_activations: bool, autocast_dtype: torch.dtype | None,
                 loss_fn: Callable[[Any, tuple], torch.Tensor], seed: int, tracer: Tracer,
                 tied_grads: str = "fast"):
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
        self.num_slots = min(2, self.k)
        self.readers = package.readers()
        self.producer = package.producers()

        dtype = store.transfer_dtype
        slot_numel = max(L.numel for L in self.layouts)
        self.slot_params = [torch.zeros(slot_numel, dtype=dtype, device=device) for _ in range(self.num_slots)]
        self.slot_grads = [torch.zeros(slot_numel, dtype=dtype, device=device) for _ in range(self.num_slots)]
        self.modules = self._bind_modules(host_buffers)
        # slot s holds (sub-model, weight epochs of what it was loaded from), or None
        self.slot_holds: list[tuple[int, tuple[int, ...]] | None] = [None] * self.num_slots
        self.epoch = [0] * self.k  # bumped whenever an update of sub-model i is scheduled
        self.loads = 0  # weight loads issued, all steps
        self.max_resident = 0  # most sub-models with weights in slots at once (always <= 2)

        if self.cuda:
            self.compute_stream = torch.cuda.Stream(device)
            self.prefetch_stream = torch.cuda.Stream(device)
            self.offload_stream = torch.cuda.Stream(device)
            torch.cuda.current_stream(device).synchronize()  # slot allocation and buffers: once
        else:
            self.compute_stream = self.prefetch_stream = self.offload_stream = None
        self.slot_loaded: list[Any] = [None] * self.num_slots  # event: slot's load done
        self.slot_free: list[Any] = [None] * self.num_slots  # event: last compute reading it done
        self.grad_free: list[Any] = [None] * self.num_slots  # event: gradient copy out of it done
        # (value, micro-batch) -> its host buffer, reused every step: views into one arena (pinned
        # on CUDA) once a step has shown every stash's shape; see _stash_buffer
        self._stash_host: dict[tuple[str, int], torch.Tensor] = {}
        self._stash_arena: HostArena | None = None
        self._stash_unplaced = False  # a buffer outside the arena was made this step
        self._unstash_ready: dict[tuple[int, int], Any] = {}
        self._has_buffers = [any(True for _ in m.buffers()) for m in self.modules]
        self._mb = 0  # micro-batch whose backward is running (read by the tie hooks)
        self._tie_stash: dict[str, dict[int, torch.Tensor]] = {}
        self._tie_fired: set[str] = set()
        self.exact_ties = self._setup_exact_ties() if tied_grads == "exact" else {}
        self._loss_host = torch.zeros((), dtype=torch.float64, pin_memory=self.cuda)
        self._loss_ready: Any = None

    # ---- set-up --------------------------------------------------------------------------------

    def _bind_modules(self, host_buffers: list[dict[str, torch.Tensor]]) -> list[nn.Module]:
        """Device sub-models whose parameters are views of their slot's flat buffers."""
        modules = self.pkg.build_submodels(device="meta")  # no weights: they are slot views
        for i, mod in enumerate(modules):
            s = i % self.num_slots
            entries = self.layouts[i].entries
            rebind_parameters(
                mod, {e.local: e.image_view(self.slot_params[s]) for e in entries},
                requires_grad=True,
                grads={e.local: e.image_view(self.slot_grads[s]) for e in entries})
            for name, buf in host_buffers[i].items():
                owner, _, leaf = name.rpartition(".")
                sub = mod.get_submodule(owner) if owner else mod
                sub._buffers[leaf] = buf.to(self.device, copy=True)
            mod.train()
        return modules

    def _setup_exact_ties(self) -> dict[str, tuple[int, str, int, str]]:
        """Sum a tied weight's gradient micro-batch by micro-batch, as the unpartitioned model does.

        By default a tie's gradient is summed per holder (sum over micro-batches in each, then
        across holders): one rounding away from the plain model's order (across holders, then
        micro-batches). "exact" keeps the later holder's per-micro-batch gradients on the device
        (C copies of the tied weight) and adds each to the owner's in the owner's backward of
        the same micro-batch, which reproduces the plain model's sums bit for bit.
        """
        pairs: dict[str, tuple[int, str, int, str]] = {}
        by_key: dict[str, list[tuple[int, str]]] = {}
        for L in self.layouts:
            for e in L.entries:
                by_key.setdefault(e.key, []).append((L.index, e.local))
        for key, holders in by_key.items():
            subs = {i for i, _ in holders}
            if len(holders) < 2 or len(subs) < 2:
                continue
            if len(holders) > 2:
                raise UsageError(f"tied_grads='exact' handles weights held by two sub-models; {key} is held "
                                 f"by {len(holders)} ({holders}); use tied_grads='fast'")
            (o, o_local), (h, h_local) = sorted(holders)
            pairs[key] = (o, o_local, h, h_local)
            self.modules[h].get_parameter(h_local).register_hook(partial(self._capture_tie, key))
            self.modules[o].get_parameter(o_local).register_hook(partial(self._add_tie, key))
        self.store.exact_keys = set(pairs)
        return pairs

    def _capture_tie(self, key: str, grad: torch.Tensor) -> None:
        self._tie_stash.setdefault(key, {})[self._mb] = grad.detach().clone()

    def _add_tie(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        self._tie_fired.add(key)
        other = self._tie_stash.get(key, {}).pop(self._mb, None)
        return grad if other is None else grad + other

    def _finish_ties(self, i: int) -> None:
        """After owner i's backward of micro-batch self._mb: add a holder gradient no hook took."""
        for key, (o, o_local, _, _) in self.exact_ties.items():
            if o != i:
                continue
            other = self._tie_stash.get(key, {}).pop(self._mb, None)
            if key not in self._tie_fired and other is not None:
                p = self.modules[o].get_parameter(o_local)
                p.grad.add_(other)
            self._tie_fired.discard(key)

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
        self.slot_holds = [None] * self.num_slots

    # ---- loads ---------------------------------------------------------------------------------

    def _content(self, i: int) -> tuple[int, tuple[int, ...]]:
        return (i, tuple(self.epoch[j] for j in self.store.load_deps[i]))

    def _load(self, i: int, wait: bool = True) -> bool:
        """Have sub-model i's current weights in slot i % 2 (issued, not necessarily done).

        With wait=False, returns False instead of waiting for a pending optimizer update.
        """
        s = i % self.num_slots
        if self.slot_holds[s] == self._content(i):
            return True
        deps = self.store.load_deps[i]
        if not wait and not self.opt.updates_done(deps):
            return False
        self.opt.wait_update(deps)
        n = self.layouts[i].numel
        nbytes = n * self.store.image[i].element_size()
        held = self.slot_holds[s]
        kind = "refresh" if held is not None and held[0] == i else "load"  # same sub-model, new weights
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
            if self.slot_free[s] is not None:
                ps.wait_event(self.slot_free[s])  # the slot's previous sub-model is done computing
            with torch.cuda.stream(ps), self.tracer.span("prefetch", i, kind, ps, nbytes, s):
                self.slot_params[s].data[:n].copy_(self.store.image[i], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(ps)
            self.slot_loaded[s] = ev
        else:
            with self.tracer.span("prefetch", i, kind, None, nbytes, s):
                self.slot_params[s].data[:n].copy_(self.store.image[i])
        self.slot_holds[s] = self._content(i)
        self.loads += 1
        self.max_resident = max(self.max_resident, len({h[0] for h in self.slot_holds if h is not None}))
        return True

    def use(self, i: int) -> None:
        """Before computing sub-model i: have its current weights in its slot (load them when the
        slot holds anything else, waiting for a pending optimizer update of them first).

        Stream contract (CUDA): the compute stream waits for the load; the caller then issues
        every computation that reads sub-model i's weights (or writes its gradients) on the
        compute stream (inside `compute()`), and calls `release(i)` after the last of them.
        """
        self._load(i)
        s = i % self.num_slots
        if self.cuda and self.slot_loaded[s] is not None:
            self.compute_stream.wait_event(self.slot_loaded[s])

    def release(self, i: int) -> None:
        """After the last computation reading sub-model i's slot was issued on the compute
        stream: the next load into that slot (on the prefetch stream) waits for it."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self.compute_stream)
            self.slot_free[i % self.num_slots] = ev

    # ---- public API: driving the slots from outside run_step ----------------------------------
    #
    # run_step runs the whole ATOM schedule of one model. A caller that schedules the sub-models
    # itself (the layout runner's swapped stage, atomc.distributed.swapstage) drives the same
    # slots with these methods and `use`, `release`, `zero_grads`:
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
        s = i % self.num_slots
        n = self.layouts[i].numel
        host = self.store.grad[i]
        nbytes = n * host.element_size()
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self.compute_stream)
            os_ = self.offload_stream
            os_.wait_event(done)
            with torch.cuda.stream(os_), self.tracer.span("offload", i, "offload", os_, nbytes):
                host.copy_(self.slot_grads[s][:n], non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(os_)
            self.grad_free[s] = ready
            return ready
        with self.tracer.span("offload", i, "offload", None, nbytes):
            host.copy_(self.slot_grads[s][:n])
        return None

    def wait_loads(self) -> None:
        """Block the host until every weight load issued so far has finished reading its host
        image, so that the images may be rewritten (refresh_images). One prefetch stream issues
        all loads in order, so the newest load event of each slot covers the older ones."""
        if self.cuda:
            for ev in self.slot_loaded:
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
            lr = self.opt.config.lr_at(step)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        self.store.refresh_images(i)
        self.epoch[i] += 1

    # ---- boundary activations ------------------------------------------------------------------

    def _stash(self, envs: list[dict[str, Any]], names: list[str], after: int) -> None:
        """Move boundary values to host memory until their backward readers need them."""
        tensors = [(n, m) for n in names for m in range(len(envs)) if isinstance(envs[m].get(n), torch.Tensor)]
        if not tensors:
            return
        nbytes = sum(envs[m][n].numel() * envs[m][n].element_size() for n, m in tensors)
        if self.cuda:
            os_ = self.offload_stream
            os_.wait_stream(self.compute_stream)
            with torch.cuda.stream(os_), self.tracer.span("offload", after, "checkpoint_out", os_, nbytes):
                for n, m in tensors:
                    t = envs[m][n]
                    host = self._stash_buffer(n, m, t)
                    host.copy_(t, non_blocking=True)
                    t.record_stream(os_)  # freed on the compute stream's side below
            ready = torch.cuda.Event()
            ready.record(os_)
        else:
            ready = None
            with self.tracer.span("offload", after, "checkpoint_out", None, nbytes):
                for n, m in tensors:
                    self._stash_buffer(n, m, envs[m][n]).copy_(envs[m][n])
        for n, m in tensors:
            envs[m][n] = _Stashed(self._stash_host[(n, m)], ready)

    def _stash_buffer(self, name: str, m: int, like: torch.Tensor) -> torch.Tensor:
        """The host buffer of value `name` of micro-batch m: a view into the stash arena.

        The shapes are only known as the forward makes the values, so the first step (or one
        whose shapes changed) stashes into ordinary memory, which is correct on CUDA too (a
        device-to-host copy into pageable memory returns when it is done; the copy back is
        staged before it returns), only slower; at the end of that step _place_stashes puts
        every buffer into one arena, pinned on CUDA, so the pinned allocator's power-of-two
        rounding is paid once and not per buffer. Pinned blocks made per buffer and freed
        would stay in PyTorch's pinned cache, which is why the first step does not pin.
        """
        buf = self._stash_host.get((name, m))
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype)
            self._stash_host[(name, m)] = buf
            self._stash_unplaced = True
        return buf

    def _place_stashes(self) -> None:
        """Move every stash buffer into one new arena (after the step that sized them)."""
        keys = list(self._stash_host)
        self._stash_arena = HostArena([(tuple(self._stash_host[k].shape), self._stash_host[k].dtype)
                                       for k in keys], pin=self.cuda)
        # the old buffers may still be read by queued copies: pageable ones were staged when the
        # copy was issued; an old arena's pinned block is kept by the allocator until they end
        self._stash_host = dict(zip(keys, self._stash_arena.buffers))
        self._stash_unplaced = False

    def pinned_bytes(self) -> int:
        """Pinned host memory of the activation stash (0 before the first offloading step)."""
        return self._stash_arena.pinned_bytes() if self._stash_arena is not None else 0

    def _unstash(self, envs: list[dict[str, Any]], i: int) -> None:
        """Issue the copies of sub-model i's stashed inputs back to the device, one per micro-batch.

        Issued on the prefetch stream when i's backward starts, before the load of P_{i-1}, so
        micro-batch m's inputs arrive while micro-batch m-1 computes (the order the simulator
        assumes); `_inputs_ready(i, m)` makes the compute stream wait for micro-batch m's.
        """
        for m, env in enumerate(envs):
            todo = [n for n in self.pkg.inputs[i] if isinstance(env.get(n), _Stashed)]
            if not todo:
                continue
            nbytes = sum(env[n].host.numel() * env[n].host.element_size() for n in todo)
            if self.cuda:
                ps = self.prefetch_stream
                for ev in {id(env[n].ready): env[n].ready for n in todo}.values():
                    ps.wait_event(ev)  # the copy to the host is done
                back = []
                with torch.cuda.stream(ps), self.tracer.span("prefetch", i, "checkpoint", ps, nbytes):
                    for n in todo:
                        host = env[n].host
                        dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                        dev.copy_(host, non_blocking=True)
                        back.append(dev)
                ready = torch.cuda.Event()
                ready.record(ps)
                self._unstash_ready[(i, m)] = ready
                for n, dev in zip(todo, back):
                    dev.record_stream(self.compute_stream)  # allocated on the prefetch stream, read on compute
                    env[n] = dev
            else:
                with self.tracer.span("prefetch", i, "checkpoint", None, nbytes):
                    for n in todo:
                        env[n] = env[n].host.clone()

    def _inputs_ready(self, i: int, m: int) -> None:
        ready = self._unstash_ready.pop((i, m), None)
        if ready is not None:
            self.compute_stream.wait_event(ready)

    # ---- the step ----------------------------------------------------------------------------

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _stream(self) -> Any:
        return torch.cuda.stream(self.compute_stream) if self.cuda else nullcontext()

    def run_step(self, micro_batches: list[tuple], step: int) -> tuple[float, StepTrace | None]:
        t_start = time.perf_counter()
        C = len(micro_batches)
        self.tracer.begin_step(step, self.compute_stream)
        scale = self.opt.begin_step(step)
        rng = _StepRng(self.device, self.seed, step, C)
        if self.cuda:
            # the caller made the batch (and anything else it hands over) on its current stream
            self.compute_stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with self._stream():
                loss_sum = self._run(micro_batches, step, rng, scale)
        finally:
            rng.restore()
        if self._stash_unplaced:
            self._place_stashes()
        if self.cuda:
            self._loss_ready.synchronize()  # this step's loss: one event, not the device
            loss = float(self._loss_host) / C
        else:
            loss = float(loss_sum) / C
        trace = self.tracer.end_step((time.perf_counter() - t_start) * 1e3)
        return loss, trace

    def _run(self, micro_batches: list[tuple], step: int, rng: _StepRng, scale: float) -> torch.Tensor:
        k, C = self.k, len(micro_batches)
        cs = self.compute_stream
        batches = [tuple(self._to_device(t) for t in mb) for mb in micro_batches]
        envs: list[dict[str, Any]] = [dict(zip(self.pkg.model_inputs, b)) for b in batches]
        fwd_states: list[list[Any]] = [[None] * C for _ in range(k)]
        buffer_states: list[list[Any]] = [[None] * C for _ in range(k)]  # see _buffers_as_in_forward
        kept: list[list[Any]] = [[None] * C for _ in range(k)]

        # forward P_0 .. P_{k-2}
        for i in range(k - 1):
            self.use(i)
            prefetched = self._load(i + 1, wait=False)
            mod = self.modules[i]
            with self.tracer.span("compute", i, "forward", cs):
                for m in range(C):
                    args = [self._value(envs[m], n) for n in self.pkg.inputs[i]]
                    if self.keep:
                        args = [_leaf(a, self.producer[n] >= 0) for a, n in zip(args, self.pkg.inputs[i])]
                    if not self.keep and self._has_buffers[i]:
                        buffer_states[i][m] = [b.clone() for b in self._buffer_slots(i)[2]]
                    with rng.forward(m) as state, self._autocast(), torch.set_grad_enabled(self.keep):
                        outs = _as_tuple(mod(*args))
                    fwd_states[i][m] = state
                    if self.keep:
                        kept[i][m] = (args, outs)
                    for n, v in zip(self.pkg.outputs[i], outs):
                        envs[m][n] = v.detach() if isinstance(v, torch.Tensor) else v
            self.release(i)
            if not prefetched:
                self._load(i + 1)
            self._free_after_forward(envs, i)

        # P_{k-1}: forward, loss and backward per micro-batch; it stays resident
        last = k - 1
        self.use(last)
        if k > 1:
            self._load(last - 1, wait=False)
        self.opt.wait_step(step - 1)  # the previous step's updates read the gradient buffers
        self.zero_grads(last)
        grads: list[dict[str, torch.Tensor]] = [{} for _ in range(C)]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        mod = self.modules[last]
        for m in range(C):
            with self.tracer.span("compute", last, "forward", cs):
                args = [_leaf(self._value(envs[m], n), self.producer[n] >= 0) for n in self.pkg.inputs[last]]
                with rng.forward(m), self._autocast():
                    out = mod(*args)
                    loss = self.loss_fn(out, batches[m])
            with self.tracer.span("compute", last, "backward", cs):
                scaled = loss / C
                if scale != 1.0:
                    scaled = scaled * scale
                self._mb = m
                scaled.backward()
                self._finish_ties(last)
                self._collect_input_grads(grads[m], last, args)
                loss_sum += loss.detach().to(torch.float64)
            del out, loss, scaled, args
        if self.cuda:  # the losses are known now; copied out while the backward goes on
            self._loss_host.copy_(loss_sum, non_blocking=True)
            self._loss_ready = torch.cuda.Event()
            self._loss_ready.record(cs)
        self.release(last)
        self._offload_grads(last)
        self._free_after_backward(envs, last)

        # backward P_{k-2} .. P_0
        for i in range(k - 2, -1, -1):
            self.use(i)
            self._unstash(envs, i)
            if i > 0:
                self._load(i - 1, wait=False)
            self.zero_grads(i)
            mod = self.modules[i]
            with self.tracer.span("compute", i, "backward", cs):
                for m in range(C):
                    self._inputs_ready(i, m)
                    out_grads = [grads[m].pop(n, None) for n in self.pkg.outputs[i]]
                    kept_m, kept[i][m] = kept[i][m], None
                    if all(g is None for g in out_grads):
                        continue  # nothing this sub-model computed reaches the loss
                    if self.keep:
                        args, outs = kept_m
                    else:
                        args = [_leaf(self._value(envs[m], n), self.producer[n] >= 0)
                                for n in self.pkg.inputs[i]]
                        with rng.replay(fwd_states[i][m]), self._autocast(), torch.enable_grad(), \
                                self._buffers_as_in_forward(i, buffer_states[i][m]):
                            outs = _as_tuple(mod(*args))
                        buffer_states[i][m] = None
                    pairs = [(o, g) for o, g in zip(outs, out_grads)
                             if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
                    self._mb = m
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    self._finish_ties(i)
                    self._collect_input_grads(grads[m], i, args)
                    del args, outs, pairs, kept_m
            self.release(i)
            self._offload_grads(i)
            self._free_after_backward(envs, i)
        return loss_sum

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
        if isinstance(v, _Stashed):  # pragma: no cover - _unstash runs before every backward
            raise AssertionError(f"value {name} used while stashed on the host")
        return v

    def _collect_input_grads(self, grads: dict[str, torch.Tensor], i: int, args: list[Any]) -> None:
        for n, a in zip(self.pkg.inputs[i], args):
            if self.producer[n] < 0 or not isinstance(a, torch.Tensor) or a.grad is None:
                continue
            grads[n] = a.grad if n not in grads else grads[n] + a.grad

    def zero_grads(self, i: int) -> None:
        """Zero sub-model i's gradient slot before its backward (on the compute stream, once the
        previous copy of that slot to the host is done)."""
        s = i % self.num_slots
        if self.cuda and self.grad_free[s] is not None:
            self.compute_stream.wait_event(self.grad_free[s])  # its last copy to the host is done
        self.slot_grads[s][:self.layouts[i].numel].zero_()

    def _offload_grads(self, i: int) -> None:
        """Sub-model i's gradients to the host in one copy; the optimizer takes over from there."""
        ready = self.grads_to_host(i)
        self.epoch[i] += 1
        self.opt.submit(i, ready)

    def _free_after_forward(self, envs: list[dict[str, Any]], i: int) -> None:
        """Drop or stash values whose last forward reader was sub-model i."""
        done = [n for n, rs in self.readers.items() if rs[-1] == i]
        if self.keep:  # the autograd graphs hold what the backward needs
            for env in envs:
                for n in done:
                    env.pop(n, None)
        elif self.offload_activations:
            self._stash(envs, done, i)

    def _free_after_backward(self, envs: list[dict[str, Any]], i: int) -> None:
        """Drop values whose first reader was sub-model i: no backward needs them any more."""
        done = [n for n, rs in self.readers.items() if rs[0] == i]
        for env in envs:
            for n in done:
                env.pop(n, None)
