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

The step is a list of actions (atomc.actions; ATOM's order by default), run by the one
interpreter (atomc.runtime.interpret.run_actions), which owns the sends and receives, the RNG
stream of each micro-batch and the buffer rule: the executor is an `Executor`
(atomc.runtime.interpret) whose verbs are the actions, `forward`, `backward`, `load`, `offload`
and `update`, so a layout's or a SWARM server's swapped stage runs its lists on it the same way.
What the verbs do beyond the action's own work, from the flags the interpreter reads off the
list: a load whose weights are still being updated is retried before each later compute and
forced at its sub-model's first use; before a sub-model's first backward the previous step's
updates are waited for and its stashed boundary values come back; its gradient slot is zeroed
then; values no later forward (or backward) reads are dropped or stashed after the last one.

Parts the executor holds, one each: `WeightSlots` (atomc.runtime.slots: the slot buffers and
what they hold), `ActivationStash` (atomc.runtime.stash: boundary values in host memory),
`TiedGrads` (atomc.runtime.ties: tied_grads="exact") and `Transfers` (atomc.runtime.transfers:
the loads and gradient copies on the streams). The executor owns the streams and the order of
the work on them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from atomc.actions import Action, ActionKind, atom_order
from atomc.runtime.cpuoptimizer import CpuOptimizer
from atomc.runtime.hostcopies import CopyLanes
from atomc.runtime.interpret import boundary_leaf, run_actions
from atomc.runtime.layouts import SubLayout, plan_layouts, rebind_parameters
from atomc.runtime.opcache import OpCache
from atomc.runtime.optim import AdamWConfig, LossScaler
from atomc.runtime.package import SwapPackage
from atomc.runtime.slots import WeightSlots
from atomc.runtime.stash import ActivationStash, Stashed
from atomc.runtime.steprun import WHOLE_MODEL, RunState, StageEnds, StepOptions, StepResult
from atomc.runtime.store import HostStore, moment_dtype
from atomc.runtime.ties import TiedGrads
from atomc.runtime.trace import StepTrace, Tracer
from atomc.runtime.transfers import Transfers

# ---------------------------------------------------------------------------------------------
# helpers


def _as_tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


def _handed_on(v: Any, weights: set[int]) -> Any:
    """A sub-model's output as later sub-models read it. An output that is a view of the
    sub-model's own weights (Perceiver's `latents.expand(batch, -1, -1)` crossing a cut) is
    copied: those weights live in a slot that the next load into it overwrites."""
    if not isinstance(v, torch.Tensor):
        return v
    v = v.detach()
    return v.clone() if v.untyped_storage().data_ptr() in weights else v


class SwapExecutor:
    """Runs training steps of a generated package on one device (see the module docstring).

    Owns the streams, the device sub-models, and the order of loads, compute and copies; holds
    the weight slots (`slots`), the activation stash (`stash`) and the exact ties (`ties`).
    An `Executor` (atomc.runtime.interpret) of every kind of action, whose indices are its
    sub-models.
    """

    action_kinds = frozenset(ActionKind)

    def __init__(self, package: SwapPackage, store: HostStore, optimizer: CpuOptimizer,
                 host_buffers: list[dict[str, torch.Tensor]], *, device: torch.device,
                 tracer: Tracer, step: StepOptions, ends: StageEnds = WHOLE_MODEL):
        self.pkg = package
        self.store = store
        self.opt = optimizer
        self.device = device
        self.cuda = device.type == "cuda"
        self.accum = step.accum
        self.activations = step.activations
        self.keep = step.activations == "keep"
        self.offload_activations = step.offload_activations
        self.autocast_dtype = step.autocast_dtype
        self.loss_fn = step.loss_fn
        self.seed = step.seed
        self.tracer = tracer
        self.k = package.num_submodels
        self.layouts: list[SubLayout] = store.layouts
        self.readers = package.readers()
        self.producer = package.producers()
        # a pipeline stage whose range ends before the model's output ends on received
        # gradients, not a loss; what it receives carries gradients back like its own values
        self.holds_output = ends.holds_output
        self.recv_names = ends.recv
        self.send_names = ends.send
        # per sub-model, the boundary values it receives that take gradients: those the model
        # computes with them at that cut (the package's BOUNDARIES say which), never the
        # model's own inputs
        computed = {n for n, p in self.producer.items() if p >= 0} | set(ends.recv)
        self.grad_inputs = [frozenset(n for n in package.inputs[i]
                                      if n in computed and package.carries_grad(n, i))
                            for i in range(self.k)]
        self.early_prefetch = step.early_prefetch and self.k > 1
        # the loss's backward: divided by the step's micro-batches (None: the list's), then
        # multiplied by the loss scale of the step
        self.loss_divisor: int | None = None
        self.loss_scale = 1.0

        self.slots = WeightSlots(self.layouts, store.load_deps, store.transfer_dtype, device)
        self.modules = self._bind_modules(host_buffers)

        if self.cuda:
            self.compute_stream = torch.cuda.Stream(device)
            self.prefetch_stream = torch.cuda.Stream(device)
            self.offload_stream = torch.cuda.Stream(device)
            torch.cuda.current_stream(device).synchronize()  # slot allocation and buffers: once
        else:
            self.compute_stream = self.prefetch_stream = self.offload_stream = None
        lanes = CopyLanes(device, tracer, self.compute_stream, self.prefetch_stream,
                          self.offload_stream)
        self.transfers = Transfers(lanes, self.slots, store, optimizer)
        self.stash = ActivationStash(lanes)
        # activations="auto": heavy operators' outputs kept or sent per the plan's quotas
        quotas = package.plan.activation_quotas
        if step.activations != "auto" or len(quotas) != self.k:
            quotas = ()
        self.opcache = OpCache(list(quotas), lanes)
        # what the buffer rule swaps per sub-model: nothing for one without buffers
        self._with_buffers = [[m] if any(True for _ in m.buffers()) else [] for m in self.modules]
        self.ties = TiedGrads(self.modules, self.layouts, exact=step.tied_grads == "exact")
        if step.tied_grads == "exact":  # summed on the device: the store's sums leave them out
            store.exact_keys = set(self.ties.ties)
        self._loss_host = torch.zeros((), dtype=torch.float64, pin_memory=self.cuda)
        self._loss_ready: Any = None
        self._run: RunState | None = None

    @classmethod
    def assemble(cls, package: SwapPackage, host_modules: list[nn.Module], config: AdamWConfig,
                 *, device: torch.device, master_dtype: torch.dtype,
                 transfer_dtype: torch.dtype | None = None, tracer: Tracer,
                 scaler: LossScaler | None = None, threaded: bool,
                 param_order: list[str] | None = None,
                 check_store: Callable[[HostStore], None] | None = None,
                 grad_slots: int | None = None,
                 disk_kinds: Sequence[frozenset[str]] = (), drives: Sequence[Any] = (),
                 written: Callable[[int], None] | None = None,
                 step: StepOptions, ends: StageEnds = WHOLE_MODEL) -> SwapExecutor:
        """Host store -> CPU optimizer -> executor over `host_modules` (one copy of the
        package's sub-models with the initial weights): the masters take their weights
        (`HostStore.bind`). `check_store` sees the store before anything is allocated on the
        device; `grad_slots`: a ring of that many host gradient buffers (None: one per
        sub-model; always so with clipping or loss scaling); `disk_kinds` and `drives`: the
        states kept on disk (atomc.runtime.tier) and where, `written(i)` after each sub-model's
        are first written there; `step` and `ends` are the executor's."""
        transfer = transfer_dtype or master_dtype
        layouts = plan_layouts(package, host_modules, config.decays, transfer_dtype=transfer)
        # clipping and loss scaling update once every gradient is in: one buffer each
        deferred = config.max_grad_norm is not None or scaler is not None
        store = HostStore(layouts, master_dtype, transfer, pin=device.type == "cuda",
                          moment_dtype=moment_dtype(config.states, master_dtype),
                          grad_slots=None if deferred else grad_slots,
                          disk_kinds=disk_kinds, drives=drives)
        try:  # a failed start leaves nothing on the offload drives
            if check_store is not None:
                check_store(store)
            store.bind(host_modules, written)
            opt = CpuOptimizer(store, config, scaler, tracer, threaded=threaded,
                               param_order=param_order)
            return cls(package, store, opt, [dict(m.named_buffers()) for m in host_modules],
                       device=device, tracer=tracer, step=step, ends=ends)
        except BaseException:
            store.close()
            raise

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
        self.transfers.synchronize()

    def wait_loads(self) -> None:
        """Block the host until every weight load issued so far has finished reading its host
        image, so that the images may be rewritten (refresh_images)."""
        self.transfers.wait_loads()

    def invalidate_slots(self) -> None:
        """Forget what the slots hold (the weights were replaced): every sub-model loads again."""
        self.slots.invalidate()

    def module(self, i: int) -> nn.Module:
        """The device sub-model i: its parameters are views of its slot (valid while it
        computes), its buffers its own device tensors."""
        return self.modules[i]

    def pinned_bytes(self) -> int:
        """Pinned host memory of the activation stash and of the operator outputs sent to host
        (each 0 before its first step that uses it)."""
        return self.stash.pinned_bytes() + self.opcache.pinned_bytes()

    def wait_offloads(self) -> None:
        """Block the host until the last list's gradient copies are on the host (each copy's
        event, not the device)."""
        for ev in self._run.all_offloads if self._run is not None else ():
            if ev is not None:
                ev.synchronize()

    def update_submodel(self, i: int, step: int) -> None:
        """AdamW on sub-model i's masters now, on the calling thread, with the gradients as they
        are in its host buffer (the caller gathered, reduced and clipped them; they must be
        on the host: `wait_offloads` first), at step `step`'s learning rate; then fresh images
        of its weights (after wait_loads: no load still reads them), and every slot whose
        content depends on them loads again before its next use."""
        self.wait_loads()
        self.opt.update_now(i, step)
        self.slots.bump(i)

    # ---- the step ------------------------------------------------------------------------------

    def _autocast(self) -> Any:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def run_step(self, micro_batches: list[tuple], step: int,
                 actions: list[Action] | None = None) -> tuple[float, StepTrace | None]:
        """One training step of the whole package: `actions` (ATOM's order by default) over
        the micro-batches; returns the mean loss and, when tracing, the step's trace."""
        t_start = time.perf_counter()
        C = len(micro_batches)
        if actions is None:
            actions = atom_order(self.k, C, early_prefetch=self.early_prefetch)
        self.tracer.begin_step(step, self.compute_stream)
        self.loss_scale = self.opt.begin_step(step)
        run_actions(self, actions, micro_batches, seed=self.seed, step=step)
        if self.cuda:
            self._loss_ready.synchronize()  # this step's loss: one event, not the device
            loss = float(self._loss_host) / C
        else:
            loss = float(self._run.loss_sum) / C
        trace = self.tracer.end_step((time.perf_counter() - t_start) * 1e3)
        return loss, trace

    def result(self) -> StepResult:
        """What the last list left: its loss sum, losses and gradient copies."""
        assert self._run is not None, "no list has run on this executor"
        return self._run.result()

    # ---- the Executor (atomc.runtime.interpret): the verbs of the actions ----------------------

    @contextmanager
    def session(self, micro_batches: list[tuple], step: int) -> Iterator[None]:
        caller = torch.cuda.current_stream(self.device) if self.cuda else None
        # the batches go to the device on the caller's stream, which the compute stream then
        # waits for (with what else the caller made before: received values)
        batches = [tuple(self.transfers.to_device(t) for t in mb) for mb in micro_batches]
        run = RunState(batches, self.pkg.model_inputs, step, caller, self.device)
        if self.cuda:
            self.compute_stream.wait_stream(caller)
        self._run = run
        try:
            with torch.cuda.stream(self.compute_stream) if self.cuda else nullcontext():
                yield
                self._between_compute()
        finally:
            run.spans.close()
            self.opcache.clear()  # what a sub-model with no backward this step stored
        self.stash.end_step()
        self.opcache.end_step()

    @contextmanager
    def exchange(self) -> Iterator[None]:
        self._between_compute()
        caller = self._run.caller
        if caller is None:
            yield
            return
        caller.wait_stream(self.compute_stream)
        with torch.cuda.stream(caller):
            yield
        self.compute_stream.wait_stream(caller)

    def recomputes(self, index: int) -> bool:
        return not self.keep and not self._is_loss(index)

    def forward_modules(self, index: int) -> list[nn.Module]:
        return self._with_buffers[index]

    def forward(self, index: int, micro: int, *, last: bool) -> None:
        """Forward of micro-batch `micro` through sub-model `index` (the loss too, with
        autograd, for the model's last sub-model); after `index`'s last forward, values no
        later forward reads are dropped or stashed (unless its backward came first)."""
        run = self._run
        self._before_compute(index, "forward")
        self._forward(index, micro)
        if last:
            self._end_span()  # its boundary values may be stashed: a copy, not compute
            if index not in run.backwarded:
                self._free_after_forward(run.envs, index)

    def backward(self, index: int, micro: int, *, first: bool, last: bool) -> None:
        """Backward of micro-batch `micro` through sub-model `index` (recomputed from its
        boundary inputs, or the graph kept from its forward, or the loss's); the gradients of
        its inputs go to their producers. Its first zeroes the gradient slot; after its last,
        the values whose first reader it is are dropped."""
        run = self._run
        self._before_compute(index, "backward", first_backward=first)
        if first:
            self.transfers.zero_grads(index)  # on the compute stream, after the slot's last copy
        self._backward(index, micro)
        if last:
            self._free_after_backward(run.envs, index)

    def load(self, index: int, *, next_first_backward: int | None, trailing: bool) -> None:
        """Issue the load of sub-model `index` (prefetch stream). While an optimizer update of
        its weights runs, it is retried before each later compute and forced at its first
        use; a trailing load (the next step's early prefetch) waits for that update. Ahead of
        a load issued for a first backward, that sub-model's stashed values stream in first."""
        self._between_compute()
        if trailing:
            self.transfers.load(index)
            return
        if next_first_backward is not None:
            self._unstash(next_first_backward)
        if not self.transfers.load(index, wait=False):
            self._run.deferred.add(index)

    def offload(self, index: int) -> None:
        """Sub-model `index`'s gradients to the host store (offload stream)."""
        self._between_compute()
        ready = self.transfers.grads_to_host(index)
        self._run.offloads[index] = ready
        self._run.all_offloads.append(ready)

    def update(self, index: int) -> None:
        """Hand sub-model `index`'s offloaded gradients to the CPU optimizer; its slot loads
        again before its next use."""
        self._between_compute()
        self.slots.bump(index)
        self.opt.submit(index, self._run.offloads.pop(index, None))

    def take_values(self, micro: int, values: dict[str, Any]) -> None:
        run = self._run
        for v in values.values():
            # made on the caller's stream, read (and freed) on the compute stream
            self.transfers.adopt(v)
        run.received[micro] = tuple(values)
        run.envs[micro].update(values)

    def take_grads(self, micro: int, grads: dict[str, torch.Tensor]) -> None:
        for n, g in grads.items():
            self._run.grads[micro][n] = self.transfers.adopt(g)

    def values_out(self, micro: int) -> dict[str, Any]:
        return {n: self._run.envs[micro][n] for n in self.send_names}

    def grads_out(self, micro: int) -> dict[str, torch.Tensor | None]:
        run = self._run
        return {n: run.grads[micro].get(n) for n in run.received.get(micro, ())}

    def losses(self) -> list[torch.Tensor]:
        return self.result().losses

    # ---- around the compute --------------------------------------------------------------------

    def _before_compute(self, i: int, kind: str, first_backward: bool = False) -> None:
        """Retry deferred loads, have sub-model i's weights in the slot, before its first
        backward wait for the previous step's updates and bring its stashed values back; then
        the compute span (one per run of a sub-model's forwards or backwards: what may load or
        wait first runs outside it)."""
        run = self._run
        if run.span != (i, kind) or run.deferred:
            self._end_span()
        for j in sorted(run.deferred):
            if self.transfers.load(j, wait=False):
                run.deferred.discard(j)
        if run.active != i:
            if run.active is not None:
                self.transfers.release(run.active)
            self.transfers.use(i)
            run.deferred.discard(i)
            run.active = i
        if first_backward:
            run.backwarded.add(i)
            if not run.waited:
                self.opt.wait_step(run.step - 1)  # those updates read the host gradients
                run.waited = True
            self._unstash(i)
            # so that the compute span starts after that wait (CUDA)
            self.transfers.wait_grad_slot(i)
        if run.span is None:
            run.spans.enter_context(self.tracer.span("compute", i, kind, self.compute_stream))
            run.span = (i, kind)

    def _end_span(self) -> None:
        self._run.spans.close()
        self._run.span = None

    def _between_compute(self) -> None:
        """Before anything but compute: the span ends, and the compute issued so far is what a
        load into the active slot (or a copy of its gradients) must wait for."""
        run = self._run
        self._end_span()
        if run.active is not None:
            self.transfers.release(run.active)
            run.active = None

    def _unstash(self, i: int) -> None:
        run = self._run
        if i not in run.unstashed:
            run.unstashed.add(i)
            self.stash.unstash(run.envs, i, self.pkg.inputs[i])
            self.opcache.fetch(i)

    # ---- F and B -------------------------------------------------------------------------------

    def _is_loss(self, i: int) -> bool:
        return self.holds_output and i == self.k - 1

    def _args(self, i: int, m: int, leaves: bool) -> list[Any]:
        names = self.pkg.inputs[i]
        args = [self._value(self._run.envs[m], n) for n in names]
        if leaves:
            args = [boundary_leaf(v, n in self.grad_inputs[i]) for v, n in zip(args, names)]
        return args

    def _forward(self, i: int, m: int) -> None:
        run = self._run
        mod = self.modules[i]
        if self._is_loss(i):
            args = self._args(i, m, leaves=True)
            with self._autocast():
                loss = self.loss_fn(mod(*args), run.batches[m])
            run.pending_loss[m] = (loss, args)
            return
        args = self._args(i, m, leaves=self.keep)
        record = self.opcache.recording(i, m) if self.opcache.active(i) else nullcontext()
        with self._autocast(), torch.set_grad_enabled(self.keep), record:
            outs = _as_tuple(mod(*args))
        if self.keep:
            run.kept[(i, m)] = (args, outs)
        env = run.envs[m]
        weights = _storages(mod)
        for n, v in zip(self.pkg.outputs[i], outs):
            env[n] = _handed_on(v, weights)

    def _backward(self, i: int, m: int) -> None:
        run = self._run
        self.ties.mb = m  # read by the tie hooks
        if self._is_loss(i):
            loss, args = run.pending_loss.pop(m)
            scaled = loss / (self.loss_divisor or run.C)
            if self.loss_scale != 1.0:
                scaled = scaled * self.loss_scale
            scaled.backward()
            self.ties.finish(i)
            self._collect_input_grads(run.grads[m], i, args)
            run.loss_sum += loss.detach().to(torch.float64)
            run.losses[m] = loss.detach()
            if self.cuda and len(run.losses) == run.C:  # copied out while the backward goes on
                self._loss_host.copy_(run.loss_sum, non_blocking=True)
                self._loss_ready = torch.cuda.Event()
                self._loss_ready.record(self.compute_stream)
            return
        if self.cuda:
            self.stash.inputs_ready(i, m)
            self.opcache.ready(i, m)
        out_grads = [run.grads[m].pop(n, None) for n in self.pkg.outputs[i]]
        kept = run.kept.pop((i, m), None)
        if all(g is None for g in out_grads):
            return  # nothing this sub-model computed reaches the loss
        if self.keep:
            args, outs = kept
        else:  # the interpreter set the forward's RNG state and buffers
            args = self._args(i, m, leaves=True)
            replay = self.opcache.replaying(i, m) if self.opcache.active(i) else nullcontext()
            with self._autocast(), torch.enable_grad(), replay:
                outs = _as_tuple(self.modules[i](*args))
        pairs = [(o, g) for o, g in zip(outs, out_grads)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.ties.finish(i)
        self._collect_input_grads(run.grads[m], i, args)

    def _value(self, env: dict[str, Any], name: str) -> Any:
        v = env[name]
        if isinstance(v, Stashed):  # pragma: no cover - unstash runs before every backward
            raise AssertionError(f"value {name} used while stashed on the host")
        return v

    def _collect_input_grads(self, grads: dict[str, torch.Tensor], i: int,
                             args: list[Any]) -> None:
        for n, a in zip(self.pkg.inputs[i], args):
            if (n not in self.grad_inputs[i] or not isinstance(a, torch.Tensor)
                    or a.grad is None):
                continue
            grads[n] = a.grad if n not in grads else grads[n] + a.grad

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
