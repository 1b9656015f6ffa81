"""Runtime, AdamW over one sub-model's flat host buffers: the kernels the CPU optimizer
(atomc.runtime.cpuoptimizer) runs for each sub-model.

- Each sub-model's weights are views, one per original parameter, of its flat master
  (gradients: views of the flat gradient buffer), in two groups: decayed and not. One flat
  tensor per group would be one kernel call, but the CPU kernels vectorise from each tensor's
  start and finish with a scalar tail, and FMA contraction differs between the two paths: the
  per-parameter views make the update the same bits as on the original tensors. The default
  implementation is torch's fused CPU kernel, about 10x faster than the foreach and for-loop
  ones here (see the README, "Host store, optimizer and tied weights").
- Where masters, gradients and moments are all plain master-dtype tensors ("direct" store,
  master-dtype moments, on the host), `DirectAdamW`: torch's AdamW on views of them. Else
  (split or separate masters, bfloat16 moments, states on disk) `ChunkedAdamW`: a chunk of
  weights at a time (hostmem.UPDATE_CHUNK) widened into a float32 scratch shared by every
  sub-model, torch's kernel on it, and the results narrowed back; states on disk are
  streamed through the store a segment at a time (HostStore.rewrite).
"""

from __future__ import annotations

from typing import Any

import torch

from atomc.runtime.optim import AdamWConfig
from atomc.runtime.store import HostStore
from atomc.runtime.tier import update_chunks


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
        checkpoint holds their record's files, atomc.runtime.masterstate)."""
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

