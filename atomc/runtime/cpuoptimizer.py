"""Runtime stage, CPU optimizer: AdamW over each sub-model's flat master buffer, on a thread.

Input: a sub-model's gradients arriving in the host store (with a CUDA event that says when the
device-to-host copy is done). Output: updated masters and images, and per sub-model futures
that the executor waits on before it loads that sub-model again — so the next forward always
sees updated weights.

- Each sub-model's update is one AdamW over its flat buffers (atomc.runtime.adamw).
- Without clipping or loss scaling, sub-model i is updated as soon as its gradients are on
  the host, in backward order, overlapping the rest of the backward ("eager").
- Global gradient-norm clipping and dynamic fp16 loss scaling need every gradient first:
  gradients are still gathered (tied replicas summed, loss scale divided out) as they
  arrive; the norm is taken when the last arrives, and the updates then run in forward
  order 0, 1, ..., k-1, overlapping the next step's forward ("deferred").
- Learning rate of step s: lr * lr_schedule(s) (a LambdaLR-style multiplier).

All of this runs on one worker thread, in submission order; torch's kernels release the GIL.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from atomc.partition import hostmem
from atomc.runtime.adamw import ChunkedAdamW, DirectAdamW
from atomc.runtime.optim import AdamWConfig, LossScaler
from atomc.runtime.store import HostStore
from atomc.runtime.trace import Tracer


@dataclass
class _StepState:
    """What the worker accumulates for one training step."""

    step: int
    scale: float
    arrived: int = 0
    grad_norm: float | None = None
    skipped: bool = False
    coef: torch.Tensor | None = None  # the clipping factor the chunked updates multiply by
    # (owner, offset) -> the norm of that weight's gradient, taken by eager updates
    norms: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


class CpuOptimizer:
    """AdamW per sub-model on the host store, run on one worker thread (see module docstring)."""

    def __init__(self, store: HostStore, config: AdamWConfig, scaler: LossScaler | None,
                 tracer: Tracer, threaded: bool = True, param_order: list[str] | None = None):
        self.store = store
        self.config = config
        self.scaler = scaler
        self.tracer = tracer
        self.k = len(store.layouts)
        self.deferred = config.max_grad_norm is not None or scaler is not None
        if self.deferred and store.grads.ring:
            raise ValueError("clipping and loss scaling update after every gradient is in: "
                             "give the store one gradient buffer per sub-model")
        # (owner, offset, numel, shape) of every trainable master, in the original model's
        # parameter order (clip_grad_norm_ skips a frozen weight: it has no gradient)
        masters = {e.key: (L.index, e.owner_offset, e.numel, e.shape) for L in store.layouts
                   for e in L.entries if e.owned and e.trainable}
        order = [k for k in dict.fromkeys(param_order or []) if k in masters]
        order += [k for k in masters if k not in set(order)]
        self.norm_order = [masters[k] for k in order]
        # masters, gradients and moments as plain master-dtype tensors: torch's AdamW over
        # views of them; anything else a chunk at a time in a shared scratch
        self.direct = (store.mode == "direct" and store.moment_dtype == store.master_dtype
                       and not any(store.disk_kinds))
        sizes = [L.trainable_numel for L in store.layouts]
        self.scratch = [] if self.direct else [
            torch.zeros(hostmem.update_scratch_numel(sizes), dtype=store.master_dtype)
            for _ in range(hostmem.UPDATE_SCRATCH_BUFFERS)]
        self.optims: list[DirectAdamW | ChunkedAdamW | None] = []
        for i, L in enumerate(store.layouts):
            decayed, plain = [], []
            wheres: dict[bool, list[slice]] = {True: [], False: []}
            for e in L.entries:
                if not e.owned or not e.trainable:  # torch's AdamW skips a frozen weight too
                    continue
                # a view per original parameter: the kernels then split the work as they do
                # on the original tensors (same bits), and nothing is copied
                where = slice(e.owner_offset, e.owner_offset + e.numel)
                p = torch.nn.Parameter(store.read_master(i)[where].view(e.shape) if self.direct
                                       else torch.empty(e.shape, device="meta"))
                (decayed if e.decay else plain).append(p)
                wheres[e.decay].append(where)
            groups = [{"params": ps, "weight_decay": wd}
                      for ps, wd in ((decayed, config.weight_decay), (plain, 0.0)) if ps]
            places = wheres[True] + wheres[False]
            # a sub-model that owns nothing (all its weights are replicas) has no optimizer
            if not groups:
                self.optims.append(None)
            elif self.direct:
                self.optims.append(DirectAdamW(store, i, groups, places, config))
            else:
                self.optims.append(ChunkedAdamW(store, i, groups, places, self.scratch, config,
                                                hostmem.UPDATE_CHUNK))
        self._pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="atomc-cpu-adamw")
                      if threaded else None)
        self.update_future: list[Future | None] = [None] * self.k
        self._futures: dict[int, list[Future]] = {}  # by step
        self._decide_future: Future | None = None
        self._current: _StepState | None = None
        self.last_grad_norm: float | None = None
        self.last_skipped = False
        self.update_ms: dict[int, float] = {}
        self._lock = threading.Lock()

    # ---- submission (main thread) --------------------------------------------------------------

    def prefetch_first(self) -> None:
        """Start reading the states of the step's first update from disk (the last sub-model
        in backward order; the first with clipping or loss scaling, which update in forward
        order)."""
        self.store.prefetch(0 if self.deferred else self.k - 1)

    def begin_step(self, step: int) -> float:
        """Start collecting a step's gradients; returns the loss scale to multiply the loss by.

        The scale depends on whether the previous step overflowed, so this waits for that
        step's global decision (taken as soon as its last gradient arrived). Failures of
        earlier work are raised here.
        """
        self._reap()
        if self.scaler is not None and self._decide_future is not None:
            self._decide_future.result()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self._current = _StepState(step, scale)
        self.prefetch_first()
        return scale

    def submit(self, i: int, ready_event: Any = None) -> None:
        """Sub-model i's gradients are (or, once `ready_event` completes, will be) on the host."""
        st = self._current
        assert st is not None
        st.arrived += 1
        if not self.deferred:
            self.update_future[i] = self._run(self._prepare_and_update, st, i, ready_event)
            return
        self._run(self._prepare, st, i, ready_event)
        if st.arrived == self.k:
            self._decide_future = self._run(self._decide, st)
            for j in range(self.k):
                self.update_future[j] = self._run(self._update, st, j)

    def _run(self, fn: Callable, *args: Any) -> Future:
        assert self._current is not None
        if self._pool is None:
            fut: Future = Future()
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - surfaced by wait_* like a threaded failure
                fut.set_exception(e)
        else:
            fut = self._pool.submit(fn, *args)
        self._futures.setdefault(self._current.step, []).append(fut)
        return fut

    def _reap(self) -> None:
        """Forget finished work, raising the first failure among it."""
        for step in list(self._futures):
            futs = self._futures[step]
            for f in futs:
                if f.done():
                    f.result()
            if all(f.done() for f in futs):
                del self._futures[step]

    def wait_update(self, indices: tuple[int, ...] | list[int]) -> None:
        """Block until the latest scheduled updates of these sub-models are done."""
        for i in indices:
            fut = self.update_future[i]
            if fut is not None:
                fut.result()

    def updates_done(self, indices: tuple[int, ...] | list[int]) -> bool:
        return all(self.update_future[i] is None or self.update_future[i].done() for i in indices)

    def wait_step(self, step: int) -> None:
        """Block until all work on the gradients of steps <= `step` is done."""
        for s in sorted(self._futures):
            if s <= step:
                for f in self._futures.pop(s):
                    f.result()

    def wait_all(self) -> None:
        while self._futures:
            for f in self._futures.pop(min(self._futures)):
                f.result()

    def close(self) -> None:
        if self._pool is not None:
            self.wait_all()
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- work (worker thread) ------------------------------------------------------------------

    @staticmethod
    def _wait_ready(event: Any) -> None:
        if event is not None:
            event.synchronize()  # this copy only: not a device-wide synchronisation

    def _gather(self, st: _StepState, i: int) -> None:
        """Where the gradient buffer is the masters' gradient (direct): the replicas' gradients
        and the loss scale into it, in place. Elsewhere the update widens them a chunk at a
        time (ChunkedAdamW), and the global norm reads them as it does."""
        if not self.direct:
            return
        self.store.add_replica_grads(i)
        if st.scale != 1.0:
            self.store.grad(i)[:self.store.layouts[i].trainable_numel].mul_(1.0 / st.scale)

    def _prepare_and_update(self, st: _StepState, i: int, event: Any) -> None:
        self._wait_ready(event)
        t0 = time.perf_counter()
        self._gather(st, i)
        self._step_one(st, i)
        t1 = time.perf_counter()
        self.update_ms[i] = (t1 - t0) * 1e3
        self.tracer.host_event(st.step, "optimizer", i, "optimizer", t0, t1)

    def _prepare(self, st: _StepState, i: int, event: Any) -> None:
        self._wait_ready(event)
        t0 = time.perf_counter()
        self._gather(st, i)
        t1 = time.perf_counter()
        self.tracer.host_event(st.step, "optimizer", i, "grad_prepare", t0, t1)

    def _decide(self, st: _StepState) -> None:
        """All gradients are in: the global norm, then skip (overflow) or clip.

        The norm is computed as torch.nn.utils.clip_grad_norm_ does — one norm per original
        parameter, in the original model's parameter order, then the norm of those — so that
        clipping gives the same bits as on the unpartitioned model.
        """
        t0 = time.perf_counter()
        total_t = self.grad_norm(1.0 / st.scale)
        total = float(total_t)
        st.grad_norm = total
        self.last_grad_norm = total
        found_inf = not math.isfinite(total)
        if self.scaler is not None:
            st.skipped = found_inf
            self.scaler.update(found_inf)
        self.last_skipped = st.skipped
        if not st.skipped and self.config.max_grad_norm is not None:
            st.coef = self.config.clip_coefficient(total_t)
            if self.direct:  # into the buffers, as clip_grad_norm_ does
                for i in range(self.k):
                    self.store.grad(i)[:self.store.layouts[i].trainable_numel].mul_(st.coef)
                st.coef = None
        self.tracer.host_event(st.step, "optimizer", -1, "grad_norm", t0, time.perf_counter())

    def grad_norm(self, inv_scale: float = 1.0) -> torch.Tensor:
        """The global norm of the gradients in the host store (one norm per original
        parameter, in the original model's order, then the norm of those: as
        torch.nn.utils.clip_grad_norm_ computes it), each as the update reads it: replicas
        summed, times `inv_scale` (the loss scale divided out; direct stores did it in place)."""
        norms = []
        for o, off, n, shape in self.norm_order:
            if self.direct:
                g = self.store.grad(o)[off:off + n]
            else:
                g = torch.empty(n, dtype=self.store.master_dtype)
                self.store.widen_grad(o, off, n, g)
                if inv_scale != 1.0:
                    g.mul_(inv_scale)
            norms.append(torch.linalg.vector_norm(g.view(shape), 2))
        return torch.linalg.vector_norm(torch.stack(norms), 2) if norms else torch.zeros(())

    def step_grad_norm(self) -> float:
        """The last step's global gradient norm, before clipping; waits for the step's updates.
        Clipping and loss scaling take it anyway; otherwise it is taken from the gradient
        buffers, or, from a ring (whose buffers went back), combined from the norms the
        updates took of each weight's gradient as they read it, as clip_grad_norm_ does."""
        self.wait_all()
        if self.deferred:
            if self.last_grad_norm is None:
                raise RuntimeError("no step has run: there is no gradient norm yet")
            return self.last_grad_norm
        if not self.store.grads.ring:  # the gradients are still in their buffers
            return float(self.grad_norm())
        st = self._current  # the step that ran last (the next has not begun)
        if st is None:
            raise RuntimeError("no step has run: there is no gradient norm yet")
        norms = [st.norms[(o, off)] for o, off, _, _ in self.norm_order]
        return float(torch.linalg.vector_norm(torch.stack(norms), 2)) if norms else 0.0

    def update_now(self, i: int, step: int) -> None:
        """Sub-model i's update on the calling thread, at step `step`'s learning rate, with the
        gradients as its buffer holds them (the caller reduced and clipped them)."""
        self._step_one(_StepState(step, 1.0), i)

    def _update(self, st: _StepState, i: int) -> None:
        if st.skipped:
            return
        t0 = time.perf_counter()
        self._step_one(st, i)
        t1 = time.perf_counter()
        self.update_ms[i] = (t1 - t0) * 1e3
        self.tracer.host_event(st.step, "optimizer", i, "optimizer", t0, t1)

    def _step_one(self, st: _StepState, i: int) -> None:
        # the next update's states start coming from disk while this one runs
        self.store.prefetch(i + 1 if self.deferred else i - 1)
        opt = self.optims[i]
        if opt is not None:
            self.config.set_lr(opt, st.step)
            # a ring gives its buffer back after the update: the gradients' norms are taken as
            # the update reads them, for step_grad_norm
            pieces: dict[int, list[torch.Tensor]] | None = {} if self.store.grads.ring else None
            if isinstance(opt, ChunkedAdamW):
                opt.step(1.0 / st.scale, st.coef, pieces)
            else:
                opt.bind_grads()
                if pieces is not None:
                    pieces.update({k: [torch.linalg.vector_norm(p.grad, 2)]
                                   for k, p in enumerate(opt.params)})
                opt.opt.step()
            if pieces is not None:
                for k, where in enumerate(opt.wheres):
                    parts = pieces.get(k) or [torch.zeros(())]
                    st.norms[(i, where.start)] = (parts[0] if len(parts) == 1 else
                                                  torch.linalg.vector_norm(torch.stack(parts)))
        self.finish_update(i)

    def finish_update(self, i: int) -> None:
        """After sub-model i's update: the replicas of its weights refreshed (frozen ones never
        change), its tied sums cleared, its replicas' gradients folded into their owners'
        sums and its gradient buffer given back (a ring's slot)."""
        store = self.store
        store.refresh_replicas(i, trained_only=True)
        store.clear_tied_sums(i)
        store.fold_replicas(i)
        store.grads.release(i)

    # ---- state -----------------------------------------------------------------------------------

    def state_dict(self) -> list[dict[str, Any] | None]:
        """Each sub-model's torch AdamW state dict; bfloat16 moments are saved as they are
        kept (a run with other moments loads them widened or rounded)."""
        self.wait_all()
        return [o.state_dict() if o is not None else None for o in self.optims]

    def load_state_dict(self, states: list[dict[str, Any] | None]) -> None:
        self.wait_all()
        for opt, state in zip(self.optims, states):
            if opt is None:
                continue
            wds = [g["weight_decay"] for g in opt.param_groups]
            opt.load_state_dict(state)
            # the trainer's own settings win over the checkpoint's (e.g. a new learning rate)
            kw = self.config.torch_kwargs()
            for g, wd in zip(opt.param_groups, wds):
                g.update(lr=kw["lr"], betas=kw["betas"], eps=kw["eps"], weight_decay=wd)

    def with_config(self, **changes: Any) -> AdamWConfig:
        return replace(self.config, **changes)
