"""Runtime stage, CPU optimizer: AdamW over each sub-model's flat master buffer, on a thread.

Input: a sub-model's gradients arriving in the host store (with a CUDA event that says when the
device-to-host copy is done). Output: updated masters and images, and per sub-model futures
that the executor waits on before it loads that sub-model again — so the next forward always
sees updated weights.

- Each sub-model has one `torch.optim.AdamW` whose parameters are views, one per original
  parameter, of the sub-model's flat master (gradients: views of the flat gradient buffer),
  in two groups: decayed and not. One flat tensor per group would be one kernel call, but the
  CPU kernels vectorise from each tensor's start and finish with a scalar tail, and FMA
  contraction differs between the two paths: the per-parameter views make the update the
  same bits as on the original tensors. The default implementation is torch's fused CPU
  kernel, about 10x faster than the foreach and for-loop ones here (see the README, "Host store,
  optimizer and tied weights").
- Without clipping or loss scaling, sub-model i is updated as soon as its gradients are on
  the host, in backward order, overlapping the rest of the backward ("eager").
- Global gradient-norm clipping and dynamic fp16 loss scaling need every gradient first:
  gradients are still gathered (tied replicas summed, loss scale divided out) as they
  arrive; the norm is taken when the last arrives, and the updates then run in forward
  order 0, 1, ..., k-1, overlapping the next step's forward ("deferred").
- Learning rate of step s: lr * lr_schedule(s) (a LambdaLR-style multiplier).
- Where masters, gradients and moments are all plain master-dtype tensors ("direct" store,
  master-dtype moments, on the host), `DirectAdamW`: torch's AdamW on views of them. Else
  (split or separate masters, bfloat16 moments, states on disk) `ChunkedAdamW`: a chunk of
  weights at a time (hostmem.UPDATE_CHUNK) widened into a float32 scratch shared by every
  sub-model, torch's kernel on it, and the results narrowed back; states on disk are
  streamed through the store a segment at a time (HostStore.rewrite).

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

from atomc.errors import UsageError
from atomc.partition import hostmem
from atomc.partition.hostmem import moment_bytes
from atomc.runtime.store import DecayFilter, HostStore
from atomc.runtime.tier import update_chunks
from atomc.runtime.trace import Tracer

IMPLS = ("fused", "foreach", "for-loop")


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = None  # global clipping, as torch.nn.utils.clip_grad_norm_
    lr_schedule: Callable[[int], float] | None = None  # step -> multiplier of lr
    impl: str = "fused"
    decay_filter: DecayFilter | None = None  # (FQN, shape) -> decay it? default: all
    # dtype the two moments are kept in on the host: "float32", or "bfloat16" (half the bytes;
    # the update computes in float32 and rounds them back to nearest, see CpuOptimizer)
    states: str = "float32"

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise UsageError(f"optimizer implementation {self.impl!r} is unknown; "
                             f"choose one of {', '.join(IMPLS)}")
        if self.lr < 0 or self.eps <= 0 or not all(0 <= b < 1 for b in self.betas):
            raise UsageError(f"AdamW settings lr={self.lr}, betas={self.betas}, eps={self.eps} are "
                             f"out of range; give lr >= 0, 0 <= betas < 1, eps > 0")
        moment_bytes(self.states)  # one line naming the choices
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise UsageError(f"max_grad_norm {self.max_grad_norm} must be positive (or None: no "
                             f"clipping)")

    def lr_at(self, step: int) -> float:
        return self.lr * (self.lr_schedule(step) if self.lr_schedule is not None else 1.0)

    def set_lr(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Step `step`'s learning rate into every group of `optimizer` (the one LR rule)."""
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr

    def decays(self, fqn: str, shape: tuple[int, ...]) -> bool:
        """Whether weight decay applies to the weight `fqn` (the one decay-group rule)."""
        return True if self.decay_filter is None else bool(self.decay_filter(fqn, tuple(shape)))

    def clip_coefficient(self, total_norm: torch.Tensor) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_'s factor for a global norm (1 without clipping)."""
        if self.max_grad_norm is None:
            return torch.ones_like(total_norm)
        return torch.clamp(self.max_grad_norm / (total_norm + 1e-6), max=1.0)

    def torch_kwargs(self) -> dict[str, Any]:
        impl = {"fused": {"fused": True}, "foreach": {"foreach": True},
                "for-loop": {"foreach": False}}[self.impl]
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                    **impl)

    @classmethod
    def coerce(cls, value: AdamWConfig | dict[str, Any] | None) -> AdamWConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise UsageError(f"optimizer settings {sorted(unknown)} are unknown; "
                                 f"known: {', '.join(cls.__dataclass_fields__)}")
            kw = dict(value)
            if "betas" in kw:
                kw["betas"] = tuple(kw["betas"])
            return cls(**kw)
        raise UsageError(f"optimizer= takes an AdamWConfig or a dict of its fields, "
                         f"got {type(value).__name__}")


def warmup_cosine(warmup_steps: int, total_steps: int,
                  min_ratio: float = 0.1) -> Callable[[int], float]:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `total_steps`."""
    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return schedule


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16 (the rule of torch.amp.GradScaler)."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0
    skipped_steps: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


class ChunkedAdamW:
    """AdamW over one sub-model's trainable weights a chunk at a time, in float32 (the master
    dtype) scratch that all sub-models share: for weights whose masters, gradients or moments
    the store does not keep as plain master-dtype tensors (a "split" store's masters, half-
    precision gradients, bfloat16 moments).

    It stands where a `torch.optim.AdamW` over the per-weight views stands (CpuOptimizer.optims,
    the executor's update): `param_groups`, whose learning rate the runtime sets each step,
    `step()`, and `state_dict()`/`load_state_dict()` in torch AdamW's format, the moments saved
    in the store's dtype (a run with float32 moments loads bfloat16 ones widened, and the other
    way round).

    The weights are cut into chunks of at most `chunk` elements in master order; a weight
    larger than a chunk is split at multiples of `chunk` from its start (see
    hostmem.UPDATE_CHUNK: the CPU kernels give the split weight the same bits). Each chunk has
    a torch AdamW (the configured implementation) over views of the scratch: a step widens the
    chunk's masters, gradients (its own, its tied replicas', times the step's loss-scale and
    clipping factors, in that order, as the whole-tensor path multiplies them) and moments
    into the scratch, runs the kernel, and writes masters and moments back (bfloat16 moments
    rounded to nearest; no stochastic rounding: with beta2 = 0.999 the second moment's change
    per step falls below a bfloat16 ulp only once gradients are steady, where it stays near its
    value anyway). Updates run one at a time (one worker thread), so one scratch serves every
    sub-model.
    """

    def __init__(self, store: HostStore, index: int, groups: list[dict[str, Any]],
                 wheres: list[slice], scratch: list[torch.Tensor], config: AdamWConfig,
                 chunk: int):
        # the per-weight optimizer it stands for: its groups, settings and state-dict format
        self.canonical = torch.optim.AdamW(groups, **config.torch_kwargs())
        self.param_groups = self.canonical.param_groups
        self.store, self.index = store, index
        self.scratch = scratch  # master, gradient and two moments, `chunk` elements each
        self.wheres = wheres
        self.shapes = [p.shape for g in self.param_groups for p in g["params"]]
        self._kinds = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        # each weight's pieces' step counts (a weight of no elements: one that never steps)
        self.steps: list[list[torch.Tensor]] = [
            [] if where.stop > where.start else [torch.zeros((), dtype=torch.float32)]
            for where in wheres]
        # per chunk (the store's: atomc.runtime.tier.update_chunks, which its disk tier
        # streams whole): (runs of (master offset, scratch offset, numel), its AdamW, group
        # indices, (weight, scratch offset, numel) of its pieces)
        self.chunks: list[tuple[list[list[int]], torch.optim.AdamW, list[int],
                                list[tuple[int, int, int]]]] = []
        for batch in update_chunks(wheres, chunk):
            self._add_chunk(batch, config)

    def _add_chunk(self, batch: list[tuple[int, int, int]], config: AdamWConfig) -> None:
        master, grad, first, second = self.scratch
        parts = []
        by_group: dict[int, list[tuple[torch.nn.Parameter, int, int, torch.Tensor]]] = {}
        runs: list[list[int]] = []
        pos = 0
        for start, n, k in batch:
            gi = self._kinds[k]
            p = torch.nn.Parameter(master[pos:pos + n])
            p.grad = grad[pos:pos + n]
            step = torch.zeros((), dtype=torch.float32)
            self.steps[k].append(step)
            by_group.setdefault(gi, []).append((p, pos, n, step))
            parts.append((k, pos, n))
            if runs and runs[-1][0] + runs[-1][2] == start:
                runs[-1][2] += n
            else:
                runs.append([start, pos, n])
            pos += n
        kinds = sorted(by_group)
        opt = torch.optim.AdamW([{"params": [p for p, *_ in by_group[gi]],
                                  "weight_decay": self.param_groups[gi]["weight_decay"]}
                                 for gi in kinds], **config.torch_kwargs())
        for gi in kinds:
            for p, at, n, step in by_group[gi]:
                opt.state[p] = {"step": step, "exp_avg": first[at:at + n],
                                "exp_avg_sq": second[at:at + n]}
        self.chunks.append((runs, opt, kinds, parts))

    def step(self, inv_scale: float = 1.0, coef: torch.Tensor | None = None,
             norms: dict[int, list[torch.Tensor]] | None = None) -> None:
        """One update, through the store (a segment at a time where its states are on disk);
        `norms` (weight -> norms of its pieces) takes the norm of each piece of gradient as
        the update reads it."""
        starts = [runs[0][0] for runs, *_ in self.chunks]

        def change(a: int, b: int) -> None:
            for c, start in enumerate(starts):
                if a <= start < b:
                    self._step_chunk(self.chunks[c], inv_scale, coef, norms)

        self.store.rewrite(self.index, change)

    def _step_chunk(self, chunk: tuple, inv_scale: float, coef: torch.Tensor | None,
                    norms: dict[int, list[torch.Tensor]] | None) -> None:
        store, i = self.store, self.index
        master, grad, *wide_moments = self.scratch
        runs, opt, kinds, parts = chunk
        for group, gi in zip(opt.param_groups, kinds):
            source = self.param_groups[gi]
            group.update(lr=source["lr"], betas=source["betas"], eps=source["eps"],
                         weight_decay=source["weight_decay"])
        for start, at, n in runs:
            store.widen_master(i, start, n, master[at:at + n])
            g = grad[at:at + n]
            store.widen_grad(i, start, n, g)
            if inv_scale != 1.0:
                g.mul_(inv_scale)
            if coef is not None:
                g.mul_(coef)
            for m, wide in enumerate(wide_moments):
                wide[at:at + n].copy_(store.moment_part(i, m, start, start + n))
        if norms is not None:
            for k, at, n in parts:
                norms.setdefault(k, []).append(torch.linalg.vector_norm(grad[at:at + n], 2))
        opt.step()
        for start, at, n in runs:
            store.narrow_master(i, start, n, master[at:at + n])
            for m, wide in enumerate(wide_moments):
                store.moment_part(i, m, start, start + n).copy_(wide[at:at + n])  # rounded

    def state_dict(self) -> dict[str, Any]:
        """torch AdamW's format; moments on disk stay there (`moments_on_disk`: the
        checkpoint holds their record's files, atomc.runtime.store.checkpoint_masters)."""
        out = self.canonical.state_dict()  # the groups; its own state stays empty
        if "moments" in self.store.disk_kinds[self.index]:
            out["state"] = {k: {"step": self.steps[k][0].clone()}
                            for k in range(len(self.wheres))}
            out["moments_on_disk"] = True
            return out
        moments = self.store.moments[self.index]
        out["state"] = {
            k: {"step": self.steps[k][0].clone(),
                "exp_avg": moments[0][where].clone().view(shape),
                "exp_avg_sq": moments[1][where].clone().view(shape)}
            for k, (where, shape) in enumerate(zip(self.wheres, self.shapes))}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Moments and steps from a torch AdamW state dict, cast into the store's dtype in place
        (no float32 copy of them); a weight the state has no entry for starts afresh. Moments
        the state leaves on disk (`moments_on_disk`) are the store's already."""
        store, i = self.store, self.index
        if state.get("moments_on_disk") or "moments" not in store.disk_kinds[i]:
            load_moments(self.param_groups, state, self.wheres, store.moments[i], self.steps)
            return
        # moments of a state dict into moments on disk: written a segment at a time
        load_moments(self.param_groups, {**state, "moments_on_disk": True}, self.wheres, (),
                     self.steps)
        saved = [s for g in state["param_groups"] for s in g["params"]]

        def change(a: int, b: int) -> None:
            for k, where in enumerate(self.wheres):
                lo, hi = max(a, where.start), min(b, where.stop)
                if lo >= hi:
                    continue
                entry = state["state"].get(saved[k])
                for m, key in enumerate(("exp_avg", "exp_avg_sq")):
                    part = store.moment_part(i, m, lo, hi)
                    if entry is None:
                        part.zero_()
                    else:
                        flat = entry[key].reshape(-1)
                        part.copy_(flat[lo - where.start:hi - where.start])

        store.rewrite(i, change)


def load_moments(param_groups: list[dict[str, Any]], state: dict[str, Any],
                 wheres: list[slice], moments: tuple[torch.Tensor, ...],
                 steps: list[list[torch.Tensor]]) -> None:
    """A torch AdamW state dict's moments into the flat `moments` (each weight at its
    `wheres`) and its step counts into `steps`, in place."""
    saved_groups = state["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in param_groups]:
        raise ValueError("loaded state dict contains a parameter group that doesn't match "
                         "the size of optimizer's group")
    ids = [i for g in saved_groups for i in g["params"]]
    for k, where in enumerate(wheres):
        saved = state["state"].get(ids[k])
        for m, key in enumerate(("exp_avg", "exp_avg_sq")):
            if state.get("moments_on_disk"):
                break  # in the checkpoint's record, which the store took
            if saved is None:
                moments[m][where].zero_()
            else:
                moments[m][where].copy_(saved[key].reshape(-1))
        for step in steps[k]:
            step.fill_(0.0 if saved is None else float(saved["step"]))


class DirectAdamW:
    """torch's AdamW over per-weight views of one sub-model's flat masters, whose gradients
    are views of its host gradient buffer and whose moments are views of the store's: where
    the store keeps masters, gradients and moments as plain master-dtype tensors (a "direct"
    store with master-dtype moments). The same bits as the optimizer on the original tensors.
    The gradients are bound anew at each step: a ring hands a sub-model another buffer each
    time."""

    def __init__(self, store: HostStore, index: int, groups: list[dict[str, Any]],
                 wheres: list[slice], config: AdamWConfig):
        self.store, self.index, self.wheres = store, index, wheres
        self.opt = torch.optim.AdamW(groups, **config.torch_kwargs())
        self.param_groups = self.opt.param_groups
        self.params = [p for g in self.param_groups for p in g["params"]]
        first, second = store.moments[index]
        self.steps = []
        for p, where in zip(self.params, wheres):
            step = torch.zeros((), dtype=torch.float32)
            self.steps.append([step])
            self.opt.state[p] = {"step": step, "exp_avg": first[where].view(p.shape),
                                 "exp_avg_sq": second[where].view(p.shape)}

    def bind_grads(self) -> None:
        grad = self.store.grad(self.index)
        for p, where in zip(self.params, self.wheres):
            p.grad = grad[where].view(p.shape)

    def step(self) -> None:
        self.bind_grads()
        self.opt.step()

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_moments(self.param_groups, state, self.wheres, self.store.moments[self.index],
                     self.steps)


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


def updates_on_a_thread(device: torch.device) -> bool:
    """Whether the runtime updates on a thread of its own, beside the compute (its default):
    on CUDA only. On a CPU device the compute already uses every core, and a second thread's
    torch work gave it a second OpenMP team: the compute's parallel regions then ran up to
    2.4x slower (a 2-core box: a mini GPT's step 299 ms with the update threaded, 164 ms with
    it on the runtime's thread; bench/RESULTS.md)."""
    return device.type == "cuda"


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
