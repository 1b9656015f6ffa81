"""Runtime stage, API: `SwapTrainer` trains a generated package with the swap executor.

Input: a package directory written by `atomc codegen` (and, for training, the model file's
`loss_fn` and initial weights). Output: training steps, checkpoints, the original model's
state dict, and a measured event trace per step.

    trainer = SwapTrainer.from_package("out/pkg", device="cuda", optimizer={"lr": 3e-4})
    loss = trainer.step(batch)          # C micro-batches; returns their mean loss
    trainer.save_checkpoint("ckpt.pt")  # atomic; SwapTrainer.from_package(..., checkpoint=...)
    state = trainer.export_state_dict() # original model's names

A batch is either the model's inputs tuple with leading dimension C x micro-batch size (split
into C equal micro-batches along dim 0), or a list of C micro-batch tuples; a model with one
input may pass a tensor instead of a 1-tuple. Every micro-batch must have the shapes the plan
was made for (PLAN["batch_size"]): memory was planned for them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atomc.errors import RuntimeMismatchError
from atomc.ir import Plan
from atomc.runtime.checkpoint import load_checkpoint, save_checkpoint
from atomc.runtime.config import TrainerConfig
from atomc.runtime.cpuoptimizer import CpuOptimizer
from atomc.runtime.executor import SwapExecutor
from atomc.runtime.hostalloc import return_freed_blocks
from atomc.runtime.layouts import rebind_parameters
from atomc.runtime.masterstate import (
    check_checkpoint_masters,
    checkpoint_masters,
    load_checkpoint_masters,
)
from atomc.runtime.package import SwapPackage, load_swap_package
from atomc.runtime.startup import (
    build_host_modules,
    check_plan,
    open_initial_weights,
    start_executor,
)
from atomc.runtime.store import HostStore
from atomc.runtime.trace import StepTrace


def _spec_dtype(spec: dict[str, Any]) -> str:
    return str(spec.get("dtype", "")).replace("torch.", "")


class SwapTrainer:
    """Swapped training of a generated package on one device (see the module docstring)."""

    def __init__(self, package: SwapPackage, executor: SwapExecutor, store: HostStore,
                 optimizer: CpuOptimizer, host_modules: list[nn.Module], *, device: torch.device,
                 accum: int, micro_batch_size: int, seed: int, plan: Plan | None = None):
        self.package = package
        self.executor = executor
        self.store = store
        self.optimizer = optimizer
        self.host_modules = host_modules  # parameters are views of the masters: export reads them
        self.device = device
        self.accum = accum
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.plan = plan  # the plan the package was generated for, when it is known
        self.step_count = 0
        self.last_loss: float | None = None
        # where the training data stands (atomc.data's PackedBatches.position()), kept in
        # checkpoints so that a resumed run reads on from there; None: not tracked
        self.data_position: dict[str, Any] | None = None
        # weights of the original model that its traced graph never reads (a classifier's
        # unused pooler, a mask token for inputs it is not given): carried through untouched,
        # on the CPU, so that export_state_dict() loads back into the model with strict=True
        self.unread: dict[str, torch.Tensor] = {}

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def from_package(cls, generated_dir: str | Path,
                     config: TrainerConfig | dict[str, Any] | None = None,
                     *, loss_fn: Callable[[Any, tuple], torch.Tensor] | None = None,
                     state_dict: dict[str, torch.Tensor] | None = None,
                     weights: str | Path | Sequence[str | Path] | None = None,
                     checkpoint: str | Path | None = None, plan: Any = None,
                     **options: Any) -> SwapTrainer:
        """Build a trainer for the package in `generated_dir`.

        What to train with: loss_fn(outputs, micro_batch) (default: the model file's);
        state_dict, the initial weights by original names (default: the model file's
        build_model() under torch.manual_seed(seed)); weights, the initial weights from
        checkpoint files instead (a directory or file, or several: safetensors, sharded with
        its index, or .bin/.pt state dicts; read tensor by tensor into the host store, see
        atomc.weights.read); checkpoint, a file to resume from; plan,
        the Plan (or its JSON path) the package must have been generated for (default: the
        package's plan.json).

        How: `config` (a TrainerConfig or a dict of its fields), with keyword `options` over it:
        device: "cpu", "cuda" or "cuda:N" (default: cuda when available).
        accum: C, micro-batches per step (default: the plan's).
        optimizer: AdamWConfig or a dict of its fields (lr, betas, eps, weight_decay,
            max_grad_norm, lr_schedule, impl, decay_filter).
        seed: the initial weights' seed and every micro-batch's RNG stream.
        activations: "auto", "recompute" or "keep" (default: the plan's); offload_activations: stash
            boundary activations in pinned host memory between their forward and backward.
        dtype: master dtype (default float32, float64 when the initial weights are float64);
            transfer_dtype: the device copy's dtype (default: the master's; bfloat16 or float16
            halve the transfers); autocast: compute dtype for torch.autocast (default: the
            transfer dtype when it is half precision); loss_scale: dynamic loss scaling
            (default: on when the transfer or the autocast dtype is float16).
        gpu_mem: the memory budget in bytes (default: the plan's capacity) checked against the
            CUDA device.
        trace: record an event trace of every step (costs one synchronisation per step).
        tied_grads: "fast" sums a tied weight's gradient per holder (one rounding away from the
            plain model); "exact" sums it micro-batch by micro-batch as the plain model does,
            bit for bit, keeping C copies of the tied weight's gradient on the device.
        threaded_optimizer: run the CPU updates on a thread of their own, beside the compute
            (default: on a CUDA device only; on the CPU the update runs on the runtime's
            thread at its place in the schedule: see optim.updates_on_a_thread).
        """
        cfg = TrainerConfig.of(config, options)
        pkg = load_swap_package(generated_dir)
        plan_data = check_plan(pkg, plan)
        typed_plan = Plan.from_json(plan_data, str(pkg.path / "plan.json")) if plan_data else None
        if typed_plan is not None and typed_plan.host is not None and (
                typed_plan.host.limit_bytes or typed_plan.host.disk_kinds):
            return_freed_blocks()  # the plan's host figure is a promise: hold it (hostalloc)
        if loss_fn is None:
            loss_fn = pkg.model_loss_fn()
        resume = load_checkpoint(checkpoint) if checkpoint is not None else None  # verified first
        files = open_initial_weights(pkg, weights, state_dict, resume, cfg.seed)  # checked, unread
        if state_dict is None and resume is None and files is None:
            state_dict = pkg.initial_state_dict(cfg.seed)
        run = cfg.resolve(pkg, typed_plan, resume=resume,
                          initial=files.dtypes() if files is not None else state_dict)
        host_modules, unread = build_host_modules(pkg, run, state_dict, files, resume)
        executor = start_executor(pkg, host_modules, run, typed_plan, loss_fn, cfg.offload_dirs)
        trainer = cls(pkg, executor, executor.store, executor.opt, host_modules,
                      device=run.device, accum=run.accum, micro_batch_size=run.micro_batch,
                      seed=run.seed, plan=typed_plan)
        try:  # a failed start leaves nothing on the offload drives
            trainer.unread = {k: state_dict[k].detach().cpu().clone() for k in unread
                              if isinstance(state_dict.get(k), torch.Tensor)}
            if files is not None:
                trainer.unread = files.load_masters(executor.store)
            if resume is not None:
                trainer.load_state_dict(resume, source=f"checkpoint {checkpoint}")
        except BaseException:
            trainer.close()
            raise
        return trainer

    # ---- training ------------------------------------------------------------------------------

    def step(self, batch: Any) -> float:
        """One optimizer step on C micro-batches; returns their mean loss."""
        micro = self.split_batch(batch)
        loss, _ = self.executor.run_step(micro, self.step_count)
        self.step_count += 1
        self.last_loss = loss
        return loss

    def split_batch(self, batch: Any) -> list[tuple]:
        C = self.accum
        names = self.package.model_inputs
        if isinstance(batch, list):
            if len(batch) != C:
                raise RuntimeMismatchError(f"got a list of {len(batch)} micro-batches, expected "
                                           f"C = {C}; give {C} micro-batches or the whole batch as "
                                           f"one tuple")
            micro = [mb if isinstance(mb, tuple) else (mb,) for mb in batch]
        else:
            full = batch if isinstance(batch, tuple) else (batch,)
            if len(full) != len(names):
                raise RuntimeMismatchError(f"the batch has {len(full)} inputs, the model takes "
                                           f"{len(names)} ({', '.join(names)})")
            micro_parts = []
            for name, t in zip(names, full):
                if not isinstance(t, torch.Tensor):
                    micro_parts.append([t] * C)
                    continue
                want = C * self.micro_batch_size
                if t.dim() == 0 or t.shape[0] != want:
                    raise RuntimeMismatchError(
                        f"input {name} has shape {list(t.shape)}; the plan expects a leading "
                        f"dimension of C x micro-batch = {C} x {self.micro_batch_size} = {want}: "
                        f"give batches of that size, or regenerate the plan for your batch size")
                micro_parts.append(list(t.chunk(C, dim=0)))
            micro = [tuple(parts[m] for parts in micro_parts) for m in range(C)]
        specs = self.package.input_specs()
        for m, mb in enumerate(micro):
            if len(mb) != len(names):
                raise RuntimeMismatchError(f"micro-batch {m} has {len(mb)} inputs, the model takes "
                                           f"{len(names)} ({', '.join(names)})")
            for name, t in zip(names, mb):
                spec = specs.get(name)
                if spec is None or "shape" not in spec or not isinstance(t, torch.Tensor):
                    continue
                if list(t.shape) != list(spec["shape"]):
                    raise RuntimeMismatchError(
                        f"input {name} of micro-batch {m} has shape {list(t.shape)}, but the plan "
                        f"was made for {list(spec['shape'])}; give micro-batches of the planned "
                        f"shape or regenerate the package for this shape")
                want_float = _spec_dtype(spec).startswith(("float", "bfloat", "complex"))
                if t.is_floating_point() != want_float:
                    raise RuntimeMismatchError(
                        f"input {name} of micro-batch {m} has dtype {t.dtype}, the plan expects "
                        f"{_spec_dtype(spec)}")
        return micro

    # ---- results ---------------------------------------------------------------------------------

    @property
    def traces(self) -> dict[int, StepTrace]:
        """Event traces of recent steps (with trace=True); waits for their optimizer work."""
        self.optimizer.wait_all()
        return self.executor.tracer.traces

    def last_trace(self) -> StepTrace | None:
        traces = self.traces
        return traces[max(traces)] if traces else None

    def wait(self) -> None:
        """Block until the device's queued work and every pending optimizer update are done."""
        self.executor.synchronize()
        self.optimizer.wait_all()

    def _sync_buffers_to_host(self) -> None:
        for host, dev in zip(self.host_modules, self.executor.modules):
            dev_bufs = dict(dev.named_buffers())
            for name, buf in host.named_buffers():
                buf.copy_(dev_bufs[name])

    def persistent_buffers(self) -> list[tuple[int, str, torch.Tensor]]:
        """(sub-model, name, host copy) of every buffer a state dict holds (running statistics,
        counters), as of the last step; non-persistent buffers are constants and left out."""
        self.wait()
        self._sync_buffers_to_host()
        out = []
        for i, m in enumerate(self.host_modules):
            persistent = m.state_dict(keep_vars=True)
            out += [(i, n, b) for n, b in m.named_buffers() if n in persistent]
        return out

    @contextmanager
    def weights_in_host_modules(self) -> Iterator[list[nn.Module]]:
        """The host sub-models with their parameters holding the masters' values: views where
        the store keeps masters whole (always so), copies made for the block where it splits
        them (a bfloat16 run keeps no float32 copy of the model otherwise)."""
        self.wait()
        self._sync_buffers_to_host()
        store = self.store
        if store.mode != "split" and not any(store.disk_kinds):
            yield self.host_modules
            return
        for i, (mod, L) in enumerate(zip(self.host_modules, store.layouts)):
            rebind_parameters(mod, {e.local: store.read_entry(i, e) for e in L.entries},
                              requires_grad=False)
        try:
            yield self.host_modules
        finally:
            for mod, L in zip(self.host_modules, store.layouts):
                rebind_parameters(mod, {e.local: torch.empty(e.shape, dtype=store.master_dtype,
                                                             device="meta")
                                        for e in L.entries}, requires_grad=False)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights by the original model's names (tied names included), on the CPU,
        with the module format versions torch's state_dict() gives (`_metadata`)."""
        with self.weights_in_host_modules() as modules:
            state = self.package.export_state_dict(modules)
            out = OrderedDict({**{k: v.clone() for k, v in self.unread.items()},
                               **{k: v.detach().clone() for k, v in state.items()}})
        if self.package.state_dict_metadata is not None:
            out._metadata = self.package.state_dict_metadata(out)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs (copies): weights, optimizer state, step, loss scale."""
        return self._state(copy=True)

    def _state(self, copy: bool, links: Path | None = None) -> dict[str, Any]:
        self.wait()
        self._sync_buffers_to_host()
        c = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())
        opt_states = self.optimizer.state_dict()
        if copy:
            opt_states = [_clone_tree(s) for s in opt_states]
        return {
            "plan_hash": self.package.plan_hash,
            "package": self.package.fingerprint(),
            "layout": [L.signature() for L in self.store.layouts],
            "master_dtype": str(self.store.master_dtype).replace("torch.", ""),
            "step": self.step_count,
            "seed": self.seed,
            "accum": self.accum,
            **checkpoint_masters(self.store, copy, links),
            "optimizer": opt_states,
            "scaler": (self.optimizer.scaler.state_dict() if self.optimizer.scaler is not None
                       else None),
            "buffers": [{n: c(b) for n, b in m.named_buffers()} for m in self.host_modules],
            "unread": {k: c(v) for k, v in self.unread.items()},
            "data_position": self.data_position,
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "state dict") -> None:
        """Restore a state from state_dict(); refused (and nothing changed) if it does not match."""
        self._validate_state(state, source)
        self.wait()
        with torch.no_grad():
            load_checkpoint_masters(self.store, state)
            for host, dev, bufs in zip(self.host_modules, self.executor.modules, state["buffers"]):
                hb, db = dict(host.named_buffers()), dict(dev.named_buffers())
                for n, b in bufs.items():
                    hb[n].copy_(b)
                    db[n].copy_(b)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.optimizer.scaler is not None and state.get("scaler"):
            self.optimizer.scaler.load_state_dict(state["scaler"])
        self.step_count = int(state["step"])
        self.seed = int(state["seed"])
        self.data_position = state.get("data_position")
        if "unread" in state:  # absent from checkpoints written before it was kept
            self.unread = {k: v.detach().cpu().clone() for k, v in state["unread"].items()}
        self.executor.seed = self.seed
        self.executor.invalidate_slots()

    def _validate_state(self, state: Any, source: str) -> None:
        if not isinstance(state, dict):
            raise RuntimeMismatchError(f"{source} is not a swap trainer state")
        missing = [k for k in ("plan_hash", "package", "layout", "step", "seed", "masters",
                               "optimizer", "buffers") if k not in state]
        if missing:
            raise RuntimeMismatchError(f"{source} lacks {', '.join(missing)}; it was not written "
                                       f"by SwapTrainer.state_dict(); nothing was loaded")
        if (state["plan_hash"] != self.package.plan_hash
                or state["package"] != self.package.fingerprint()):
            raise RuntimeMismatchError(
                f"{source} belongs to plan {state['plan_hash']} (package {state['package']}), but "
                f"this trainer runs plan {self.package.plan_hash} (package "
                f"{self.package.fingerprint()}) from "
                f"{self.package.path}; load it into a trainer of the package it was written from; "
                f"nothing was loaded")
        layout = [L.signature() for L in self.store.layouts]
        if _plain(state["layout"]) != _plain(layout):
            raise RuntimeMismatchError(f"{source} has another parameter layout than "
                                       f"{self.package.path}; nothing was loaded")
        problem = check_checkpoint_masters(self.store, state)
        if problem:
            raise RuntimeMismatchError(f"{source}: {problem}; nothing was loaded")
        if len(state["optimizer"]) != len(self.store.layouts):
            raise RuntimeMismatchError(f"{source} has optimizer state for "
                                       f"{len(state['optimizer'])} sub-models, expected "
                                       f"{len(self.store.layouts)}; nothing was loaded")

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write the state to `path` atomically (temporary file, fsync, rename); states on disk
        are hard-linked beside the run's files, in folders named after `path`."""
        return save_checkpoint(path, self._state(copy=False, links=Path(f"{path}.states")))

    def save_pretrained(self, directory: str | Path, *, max_shard_size: int | str = "2GB",
                        dtype: str | torch.dtype | None = None) -> Path:
        """Write the weights to `directory` as transformers, peft or safetensors load them:
        safetensors shards (with their index) under the model's own names and, for a model
        built from a transformers config, its config.json; a peft model's adapter in peft's
        format (atomc.weights.write). Atomic; `dtype` casts floating-point weights."""
        from atomc.weights import save_pretrained
        return save_pretrained(self, directory, max_shard_size=max_shard_size, dtype=dtype)

    def load_checkpoint(self, path: str | Path) -> None:
        """Resume from `path`; a corrupt or foreign checkpoint is refused and nothing changes."""
        state = load_checkpoint(path)
        self.load_state_dict(state, source=f"checkpoint {path}")

    def close(self) -> None:
        """Finish pending work (device copies, optimizer updates), stop the optimizer thread
        and remove the run's files from the offload drives (a checkpoint's stay)."""
        self.executor.synchronize()
        self.optimizer.close()
        self.store.close()

    def describe(self) -> str:
        """A short text form: sub-models, their sizes, and the step's settings."""
        from atomc.units import format_bytes
        s = self.store
        pinned = s.pinned_bytes() + self.executor.pinned_bytes()
        stores = [i for i in range(len(s.layouts)) if self.executor.opcache.active(i)]
        acts = ("keep" if self.executor.keep else
                f"auto (sub-models {', '.join(map(str, stores))} store operator outputs)"
                if stores else "recompute")
        if self.executor.offload_activations:
            acts += " (boundary activations offloaded)"
        lines = [(f"swap trainer: {len(s.layouts)} sub-models on {self.device}, C = {self.accum}, "
                  f"micro-batch {self.micro_batch_size}, activations {acts}"),
                 (f"  master {str(s.master_dtype)[6:]}, transfer {str(s.transfer_dtype)[6:]}, "
                  f"host {format_bytes(s.host_bytes())} (pinned {format_bytes(pinned)})")]
        for L in s.layouts:
            tied = sum(1 for e in L.entries if not e.owned)
            lines.append(f"  P{L.index}: {format_bytes(s.param_bytes(L.index)):>11s} in "
                         f"{len(L.entries)} tensors{f' ({tied} tied replicas)' if tied else ''}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def _plain(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _clone_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone_tree(v) for v in x]
    return x
