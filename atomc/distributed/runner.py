"""Layout runner, per rank: generated package + DT-FM layout -> pipeline x data-parallel training.

input:  the generated package, the layout (D_PP x D_DP tasklets, stage -> sub-model range), the
        world torchrun launched, the model file's loss_fn, initial weights, and per step the global
        batch (every rank reads the same batch; each replica takes its slice of it)
output: training steps whose losses and parameters are those of single-process training on the
        same global batch; per-stage checkpoints; metrics

One step on rank (replica i, stage j):
  1. this replica's slice of the global batch, cut into M micro-batches;
  2. the stage's tasks in GPipe (or 1F1B) order; activations and their gradients go to the
     neighbouring stages of the same replica with asynchronous isend/irecv (`pipeline.Link`);
  3. the gradients of tied weights held by several stages (GPT's wte / lm_head) are summed among
     those stages of the replica, as Megatron does for its embeddings;
  4. the stage's gradients are averaged by hand over its data-parallel group (one flat buffer;
     an all-reduce, or DT-FM's sharded exchange over point-to-point sends) - not DDP;
  5. optional global-norm clipping (the norm summed over the stages), then the optimizer.

Resident or swapped: a stage runs swapped when `swap_stages` names it or when, kept resident
(weights, gradients, AdamW moments and the activations of its micro-batches in flight), it does
not fit its device's memory budget: `memory_budget_bytes` when given, else the device's
`memory_bytes` in the layout's network, else a CUDA device's total memory, each of the last two
less a reserve (the plan's, as `atomc partition --reserve`). Any swapped stage makes the layout
run GPipe, and the stages are decided again for GPipe's micro-batches in flight
(`decide_swaps`); rank 0 logs each stage's decision and why.

Checkpoints: every `checkpoint_every` steps each rank writes its tasklet's state (weights,
optimizer, step) to `DIR/step_NNNNNNNN/replica_I.stage_J.pt` atomically (temporary file, fsync,
rename, with a checksum), all ranks meet at a barrier, and each keeps its two newest files. A
start (or an elastic restart under torchrun) resumes from the newest step that every rank has.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atomc.actions import PIPELINE_ORDERS
from atomc.distributed.checkpoints import TaskletCheckpoints
from atomc.distributed.collectives import Collectives
from atomc.distributed.groups import (
    Groups,
    LayoutView,
    Placement,
    assign,
    build_groups,
    check_world,
    device_claim,
    layout_view,
    with_ranges,
)
from atomc.distributed.pipeline import Link, Transport
from atomc.distributed.swapping import DeviceBudget, decide_swaps, device_budget, resident_need
from atomc.errors import LayoutError, RuntimeMismatchError, UsageError
from atomc.runtime.optim import AdamWConfig
from atomc.runtime.package import SwapPackage, load_swap_package
from atomc.runtime.rng import RNG_VALUE
from atomc.stages.base import Stage, stage_dtype
from atomc.stages.cut import cut_stages, package_plan
from atomc.stages.make import make_stage

TAG_DP = 21
TAG_TIED = 23


@dataclass
class LayoutConfig:
    package: str | Path
    layout: Any  # path, Layout document or LayoutView
    global_batch: int  # samples per optimizer step, all replicas together
    network: Any = None  # the layout's network (path or Network): link delays for --emulate-delay
    micro_batch: int | None = None  # samples per micro-batch (default: the plan's batch size)
    schedule: str = "gpipe"
    optimizer: AdamWConfig | dict[str, Any] | None = None
    device: str = "cpu"  # "cpu" or "cuda" (this rank's LOCAL_RANK-th GPU)
    dtype: str | None = None  # "float64" to train in double precision (tests)
    swap_stages: tuple[int, ...] = ()  # stages to run with the swap executor whatever their size
    # per device; stages that do not fit are swapped. None: the device's memory (the network's
    # memory_bytes, else a CUDA device's total) less `memory_reserve_bytes`
    memory_budget_bytes: int | None = None
    memory_reserve_bytes: int | None = None  # None: the plan's reserve (atomc partition --reserve)
    checkpoint_dir: str | Path | None = None
    checkpoint_every: int = 0  # steps; 0: never
    keep_checkpoints: int = 2
    # "allreduce", "p2p" (sharded exchange), "auto": p2p when delays emulate links
    dp_reduce: str = "auto"
    emulate_delay: bool = False  # add the layout's link delays in the send path
    timeout_s: float = 120.0  # every collective and receive
    seed: int = 0
    metrics_path: str | Path | None = None
    window: int = 2  # receives posted ahead

    def __post_init__(self) -> None:
        if self.schedule not in PIPELINE_ORDERS:
            raise UsageError(f"schedule {self.schedule!r} is unknown; choose one of "
                             f"{', '.join(PIPELINE_ORDERS)}")
        if self.dp_reduce not in ("auto", "allreduce", "p2p"):
            raise UsageError(f"dp_reduce {self.dp_reduce!r}: choose auto, allreduce or p2p")
        for name in ("memory_budget_bytes", "memory_reserve_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UsageError(f"{name} is {value}; give a size of 0 bytes or more")


def check_package(pkg: SwapPackage, layout: LayoutView) -> LayoutView:
    """The package must be the one the layout's plan was cut into; returns the layout with its
    stage ranges (computed from the package's plan when the layout was scheduled without one)."""
    if layout.plan_hash and pkg.plan_hash and layout.plan_hash != pkg.plan_hash:
        raise LayoutError(
            f"{layout.source} was scheduled for plan {layout.plan_hash}, but the package "
            f"{pkg.path} was generated from plan {pkg.plan_hash}; give the package generated from "
            f"the layout's plan (atomc codegen PLAN.json) or schedule again with --plan for this "
            f"package's plan")
    if not layout.stage_ranges:
        layout = with_ranges(layout, package_plan(pkg))
    return layout.check(pkg.num_submodels)


class LayoutTrainer(TaskletCheckpoints):
    """One rank of a layout run (see the module docstring)."""

    def __init__(self, cfg: LayoutConfig, loss_fn: Callable[[Any, tuple], torch.Tensor],
                 initial_state: (Callable[[], dict[str, torch.Tensor]] | dict[str, torch.Tensor]
                                 | None)):
        import torch.distributed as dist

        self.cfg = cfg
        self.dist = dist
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        world_rank = int(os.environ.get("RANK", "0"))
        forced = self._read_inputs(world_size, world_rank)
        self._join(world_size, world_rank)
        self._decide_stage(world_size, forced, loss_fn)
        self._connect(world_size, world_rank)
        self.step_count = 0
        self.step_ms: list[float] = []
        self.losses: dict[int, float] = {}
        self.resumed_from: int | None = None
        # weights of the initial state that no sub-model holds (the graph never reads them):
        # the first stage carries them through its checkpoints to the final state, so that
        # the merged state loads back into the model with strict=True
        self.unread: dict[str, torch.Tensor] = {}
        if self.resume() is None:
            self._load_initial(initial_state)

    # ---- set-up --------------------------------------------------------------------------------

    def _read_inputs(self, world_size: int, world_rank: int) -> tuple[int, ...]:
        """The layout, the package, the optimizer and the devices' budgets from the network,
        each checked on every rank before any rendezvous, so that a bad input stops them all
        with the same line; returns the stages named to run swapped."""
        cfg = self.cfg
        self.layout = layout_view(cfg.layout, network=cfg.network)
        check_world(self.layout, world_size, world_rank)  # before any rendezvous: fail fast
        forced = self._forced_swaps()
        if cfg.emulate_delay and not self.layout.delay_ms:
            raise UsageError("emulating link delays needs the layout's network: "
                             "give --network NET.json")
        self.pkg = load_swap_package(cfg.package)
        self.layout = check_package(self.pkg, self.layout)
        self.opt_cfg = AdamWConfig.coerce(cfg.optimizer)
        self.dtype = stage_dtype(cfg.dtype)
        self._batch_split()  # a batch that does not split stops every rank here
        self.plan = package_plan(self.pkg)
        self.reserve = (cfg.memory_reserve_bytes if cfg.memory_reserve_bytes is not None
                        else self.plan.reserve_bytes)
        # a device the reserve leaves nothing of stops every rank with the same line
        in_layout = {d for row in self.layout.devices for d in row}
        self.network_budgets = {
            name: device_budget(name, cfg.memory_budget_bytes, memory,
                                "memory_bytes in the network", self.reserve)
            for name, memory in sorted(self.layout.memory_bytes.items()) if name in in_layout}
        return forced

    def _join(self, world_size: int, world_rank: int) -> None:
        """This rank's device, the process group, its place in the layout, and the same
        package on every rank."""
        dist = self.dist
        self.device = self._device()
        if not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            _loopback_for_gloo()
            dist.init_process_group(backend,
                                    timeout=datetime.timedelta(seconds=self.cfg.timeout_s))
        claims: list[Any] = [None] * world_size
        dist.all_gather_object(claims, device_claim())
        self.place: Placement = assign(self.layout, world_size, world_rank, claims)
        self._agree_on_package()

    def _decide_stage(self, world_size: int, forced: tuple[int, ...], loss_fn) -> None:
        """The stage's spec and groups, and whether it runs swapped: every rank decides every
        stage from the budgets of all devices, so that all make the same decision."""
        j = self.place.stage
        self.specs = cut_stages(self.pkg, self.layout.stage_ranges)
        self.spec = self.specs[j]
        tied_sets = self._tied_stage_sets()
        self.groups: Groups = build_groups(self.place, list(tied_sets.values()))
        self.tied_sets = tied_sets  # FQN -> stages holding it
        budgets: list[Any] = [None] * world_size
        self.dist.all_gather_object(budgets, self._device_budget())
        by_stage = [[budgets[self.place.world(i, s)] for i in range(self.layout.dp)]
                    for s in range(self.layout.pp)]
        self.swap = decide_swaps(self.cfg.schedule, by_stage, forced, self.resident_need)
        self.schedule_name = self.swap.schedule
        self.stage: Stage = make_stage(j in self.swap.swapped, self.pkg, self.spec,
                                       self.device, loss_fn, self.opt_cfg, dtype=self.dtype,
                                       seed=self.cfg.seed)
        self.params = self.stage.named_parameters()

    def _connect(self, world_size: int, world_rank: int) -> None:
        """The transport (with the links' delays when emulated), the collectives and the
        links to the neighbouring stages of this replica."""
        cfg = self.cfg
        delays = {}
        if cfg.emulate_delay:
            for r in range(world_size):
                if r != world_rank:
                    delays[r] = self.place.link_delay_ms(r)
        self.dp_mode = (cfg.dp_reduce if cfg.dp_reduce != "auto"
                        else ("p2p" if cfg.emulate_delay else "allreduce"))
        # one process group per link direction (groups.link_groups): see pipeline.py, Ordering
        self.transport = Transport(self.device, delays, links=self.groups.links, rank=world_rank)
        self.collectives = Collectives(self.dist, self.device, self.dp_mode, self.transport)
        j = self.place.stage
        where = f"replica {self.place.replica} stage {j}"
        # every link carries the micro-batch's RNG state besides the boundary values
        # and says which values carry a gradient back (those the model computes with them at
        # the link's cut)
        spec = self.spec
        self.link_in = Link(self.transport, self.place.prev, spec.recv + (RNG_VALUE,),
                            window=cfg.window, where=where,
                            grads=self.pkg.grads_at(spec.start)) if j > 0 else None
        self.link_out = (Link(self.transport, self.place.next, spec.send + (RNG_VALUE,),
                              window=cfg.window, where=where,
                              grads=self.pkg.grads_at(spec.stop))
                         if self.place.next is not None else None)

    def _load_initial(self, initial_state) -> None:
        """The original model's weights into the stage (no checkpoint to resume from)."""
        state = initial_state() if callable(initial_state) else initial_state
        if state is None:
            raise UsageError("no initial weights and no checkpoint to resume from; give the "
                             "original model's state dict (or a checkpoint directory)")
        self.stage.load_original(state)
        if self.place.stage == 0:
            self.unread = {k: state[k].detach().cpu().clone()
                           for k in self.pkg.unread_names(state)
                           if isinstance(state[k], torch.Tensor)}


    def _device(self) -> torch.device:
        if self.cfg.device == "cpu":
            return torch.device("cpu")
        if self.cfg.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise UsageError("--device cuda asked for, but this machine has no CUDA device; "
                                 "use --device cpu")
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            return torch.device("cuda", local)
        raise UsageError(f"device {self.cfg.device!r}: expected cpu or cuda")

    def _agree_on_package(self) -> None:
        mine = (self.pkg.fingerprint(), self.pkg.plan_hash,
                self.layout.digest or self.layout.source)
        everyone: list[Any] = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(everyone, mine)
        odd = [r for r, x in enumerate(everyone) if x[:2] != mine[:2]]
        if odd:
            raise LayoutError(
                f"ranks {odd} run another generated package (fingerprint {everyone[odd[0]][0]}, "
                f"plan {everyone[odd[0]][1]}) than rank {self.dist.get_rank()} ({mine[0]}, plan "
                f"{mine[1]}); give every rank the same package")
        odd = [r for r, x in enumerate(everyone) if x[2] != mine[2]]
        if odd:
            raise LayoutError(f"ranks {odd} read another layout than rank "
                              f"{self.dist.get_rank()}; give every rank the same layout file")

    def _tied_stage_sets(self) -> dict[str, tuple[int, ...]]:
        stage_of = {}
        for j, (a, b) in enumerate(self.layout.stage_ranges):
            for i in range(a, b):
                stage_of[i] = j
        out = {}
        for fqn, holders in sorted(self.pkg.tied.items()):
            stages = tuple(sorted({stage_of[i] for i, _ in holders}))
            if len(stages) > 1:
                out[fqn] = stages
        return out

    def _forced_swaps(self) -> tuple[int, ...]:
        pp = self.layout.pp
        bad = sorted({s for s in self.cfg.swap_stages if not 0 <= s < pp})
        if bad:
            raise UsageError(f"swap_stages names stages {bad}, but {self.layout.source} has stages "
                             f"0..{pp - 1}; name stages of the layout")
        return tuple(self.cfg.swap_stages)

    def _device_budget(self) -> DeviceBudget:
        """This rank's memory budget (`device_budget`): its device's memory is the network's
        `memory_bytes` for it, else a CUDA device's total memory."""
        name = self.place.device_name
        if name in self.network_budgets:
            return self.network_budgets[name]
        total = source = None
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            total, source = props.total_memory, f"the total memory of {self.device} ({props.name})"
        return device_budget(name, self.cfg.memory_budget_bytes, total, source or "",
                             self.reserve)

    def resident_need(self, stage: int, schedule: str) -> tuple[int, int]:
        """(bytes, micro-batches in flight) of stage `stage` kept resident under `schedule`."""
        return resident_need(self.plan, self.layout.stage_ranges, self.num_micro, stage, schedule)

    @property
    def num_micro(self) -> int:
        per_replica, mb = self._batch_split()
        return per_replica // mb

    def _batch_split(self) -> tuple[int, int]:
        dp = self.layout.dp
        g = self.cfg.global_batch
        mb = self.cfg.micro_batch or self.pkg.plan.batch_size or 1
        if g % dp:
            raise UsageError(f"global batch {g} does not split over {dp} replicas; give a multiple "
                             f"of {dp}")
        per = g // dp
        if per % mb:
            raise UsageError(f"each replica gets {per} samples, not a multiple of the micro-batch "
                             f"{mb}; give a global batch that is a multiple of {dp} x {mb}")
        return per, mb

    # ---- data ----------------------------------------------------------------------------------

    def micro_batches(self, batch: Any) -> list[tuple]:
        """This replica's slice of the global batch, as M micro-batches on the device."""
        full = batch if isinstance(batch, tuple) else (batch,)
        per, mb = self._batch_split()
        lo = self.place.replica * per
        out = []
        for m in range(per // mb):
            parts = []
            for t in full:
                if isinstance(t, torch.Tensor):
                    if t.shape[0] != self.cfg.global_batch:
                        raise RuntimeMismatchError(
                            f"an input has leading dimension {t.shape[0]}, but the global batch is "
                            f"{self.cfg.global_batch}; give the whole global batch to every rank")
                    part = t[lo + m * mb: lo + (m + 1) * mb].to(self.device)
                    if self.dtype is not None and part.is_floating_point():
                        part = part.to(self.dtype)  # training in float64: its inputs too
                    parts.append(part)
                else:
                    parts.append(t)
            out.append(tuple(parts))
        return out

    # ---- a step --------------------------------------------------------------------------------

    def step(self, batch: Any) -> float | None:
        """One optimizer step on the global batch; the global mean loss on last-stage ranks."""
        t0 = time.perf_counter()
        micro = self.micro_batches(batch)
        M = len(micro)
        st = self.stage
        st.begin_step(self.step_count, M, first_micro=self.place.replica * M)
        io = StageIO(self.link_in, self.link_out, M)
        losses = st.run(st.order(self.schedule_name, M), micro, io)
        self.transport.flush(self.cfg.timeout_s)
        self._reduce_and_update()
        self.step_count += 1
        loss = self._global_loss(losses, M)
        self.step_ms.append((time.perf_counter() - t0) * 1e3)
        if loss is not None:
            self.losses[self.step_count - 1] = loss
        self._log(loss)
        if self.cfg.checkpoint_dir and self.cfg.checkpoint_every and \
                self.step_count % self.cfg.checkpoint_every == 0:
            self.save_checkpoint()
        return loss

    def _global_loss(self, losses: list[torch.Tensor], M: int) -> float | None:
        if not self.spec.holds_output:
            return None
        local = torch.stack([x.to(torch.float64) for x in losses]).sum() / M
        if self.layout.dp > 1:
            local = local.to(self.device)
            self.dist.all_reduce(local, group=self.groups.dp)
            local = local / self.layout.dp
        return float(local)

    # ---- gradients, optimizer --------------------------------------------------------------------

    def _grads(self, params: list[tuple[str, Any]]) -> list[torch.Tensor]:
        out = []
        for _, p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def _reduce_and_update(self) -> None:
        st = self.stage
        params = self.params
        # 3. tied weights: sum over the stages of this replica that hold them
        by_set: dict[tuple[int, ...], list[str]] = {}
        for fqn, stages in self.tied_sets.items():
            if self.place.stage in stages:
                by_set.setdefault(stages, []).append(fqn)
        named = dict(params)
        for stages, fqns in sorted(by_set.items()):
            grads = self._grads([(f, named[f]) for f in fqns])
            ranks = [self.place.world(self.place.replica, s) for s in stages]
            self.collectives.sum(grads, self.groups.tied[stages], ranks, TAG_TIED, average=False,
                                 direct=True)
        # 4. data parallelism: average over the replicas of this stage
        if self.layout.dp > 1:
            ranks = [self.place.world(i, self.place.stage) for i in range(self.layout.dp)]
            self.collectives.sum(self._grads(params), self.groups.dp, ranks, TAG_DP, average=True)
        # 5. clipping and the update
        coef = self._clip_coefficient(params) if self.opt_cfg.max_grad_norm is not None else None
        st.optimizer_step(coef)
        # buffers (running statistics) follow replica 0, as DDP's broadcast_buffers does
        if self.layout.dp > 1:
            for b in st.buffers().values():
                flat = b.detach().to(self.device)
                self.dist.broadcast(flat, src=self.place.world(0, self.place.stage),
                                    group=self.groups.dp)
                b.copy_(flat)

    def _clip_coefficient(self, params: list[tuple[str, Any]]) -> float:
        """torch.nn.utils.clip_grad_norm_'s coefficient for the whole model: squared norms summed
        over the stages of the replica, a tied weight counted once (on its first stage)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for fqn, p in params:
            stages = self.tied_sets.get(fqn)
            if stages is not None and stages[0] != self.place.stage:
                continue
            if p.grad is not None:
                sq += p.grad.detach().to(torch.float64).pow(2).sum()
        if self.layout.pp > 1:
            self.dist.all_reduce(sq, group=self.groups.pipeline)
        return float(self.opt_cfg.clip_coefficient(sq.sqrt()))

    # ---- results -------------------------------------------------------------------------------

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights by original FQN (tied weights under their canonical name)."""
        return self.stage.export()

    def _log(self, loss: float | None) -> None:
        if self.cfg.metrics_path is None or loss is None or self.place.replica != 0:
            return
        line = {"step": self.step_count - 1, "loss": loss, "step_ms": self.step_ms[-1],
                "time": time.time(),
                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        with open(self.cfg.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self.transport.close()
        self.stage.close()


def _loopback_for_gloo() -> None:
    """On one machine (rendezvous on loopback) gloo binds to `lo`, not the host's first NIC."""
    addr = os.environ.get("MASTER_ADDR", "")
    if "GLOO_SOCKET_IFNAME" not in os.environ and addr in ("127.0.0.1", "localhost", "::1"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


class StageIO:
    """A stage's S and R actions over its links (atomc.actions): one call per micro-batch, in
    micro-batch order; receives are posted ahead (`Link.expect`)."""

    def __init__(self, link_in: Link | None, link_out: Link | None, num_micro: int):
        self.link_in = link_in
        self.link_out = link_out
        if link_in is not None:
            link_in.expect(num_micro)
        if link_out is not None:
            link_out.expect_grads(num_micro)

    def recv(self, m: int) -> dict[str, Any]:
        return self.link_in.recv()

    def send(self, m: int, values: dict[str, Any]) -> None:
        self.link_out.send(values)

    def recv_grads(self, m: int) -> dict[str, torch.Tensor]:
        return self.link_out.recv_grads()

    def send_grads(self, m: int, grads: dict[str, Any], received: dict[str, Any]) -> None:
        self.link_in.send_grads(grads, received)



def run_layout(cfg: LayoutConfig, loss_fn: Callable, initial_state: Any,
               batch_of: Callable[[int], Any], steps: int, *, final_dir: str | Path | None = None,
               log: Callable[[str], None] = print) -> LayoutTrainer:
    """Train `steps` steps (resuming from a checkpoint when there is one); every rank calls this."""
    trainer = LayoutTrainer(cfg, loss_fn, initial_state)
    try:
        if trainer.place.world_rank == 0:
            log(trainer.layout.text())
            for line in trainer.swap.lines(cfg.schedule):
                log(line)
        log(trainer.place.describe() + f", {trainer.stage.kind}, "
            f"{trainer.schedule_name}, {trainer.num_micro} micro-batches"
            + (f", resumed at step {trainer.resumed_from}"
               if trainer.resumed_from is not None else ""))
        while trainer.step_count < steps:
            s = trainer.step_count
            loss = trainer.step(batch_of(s))
            if loss is not None and trainer.place.replica == 0:
                log(f"step {s}: loss {loss:.6f} ({trainer.step_ms[-1]:.1f} ms)")
        if final_dir is not None:
            d = Path(final_dir)
            if trainer.place.replica == 0:
                from atomc.runtime.checkpoint import save_checkpoint

                params = trainer.stage_state_dict()
                buffers = {k: b.detach().cpu().clone()
                           for k, b in trainer.stage.buffers().items()}
                metadata = trainer.pkg.state_dict_metadata
                save_checkpoint(d / f"final_stage_{trainer.place.stage}.pt",
                                {"params": params, "unread": trainer.unread, "buffers": buffers,
                                 "losses": {str(k): v for k, v in trainer.losses.items()},
                                 "step_ms": trainer.step_ms,
                                 # the modules' state-dict format versions (final_state)
                                 "metadata": dict(metadata([*params, *trainer.unread,
                                                            *buffers]))
                                 if metadata is not None else {}})
        trainer.dist.barrier()
    finally:
        trainer.close()
    return trainer


__all__ = [
    "LayoutConfig",
    "LayoutTrainer",
    "StageIO",
    "check_package",
    "run_layout",
]
