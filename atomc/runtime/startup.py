"""Runtime stage, a trainer's start: what `SwapTrainer.from_package` checks, opens and builds
before the first step.

The plan the package was generated for (`check_plan`), the initial weights' files
(`open_initial_weights`), one copy of the sub-models on the host with the initial weights
(`build_host_modules`), and the executor with its host store and CPU optimizer
(`start_executor`), once the host memory, the device memory (`check_device_memory`) and the
offload drives are checked: each refused in one line before anything is allocated.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atomc.dtypes import cast_floating
from atomc.errors import RuntimeMismatchError, UsageError
from atomc.ir import Plan
from atomc.jsonio import canonical_hash, read_json
from atomc.runtime.config import RunSettings
from atomc.runtime.executor import SwapExecutor
from atomc.runtime.layouts import plan_layouts, planned_host_bytes
from atomc.runtime.optim import LossScaler
from atomc.runtime.package import SwapPackage
from atomc.runtime.steprun import StepOptions
from atomc.runtime.store import HostStore
from atomc.runtime.trace import Tracer
from atomc.trace import parameters_on_meta


def build_host_modules(pkg: SwapPackage, run: RunSettings, state_dict: dict[str, Any] | None,
                       files: Any, resume: dict[str, Any] | None
                       ) -> tuple[list[nn.Module], list[str]]:
    """One copy of the package's sub-models in the master dtype with the initial weights (those
    of `state_dict`, or the buffers of `files`), and the names of the state dict's weights the
    traced graph never reads."""
    # weights from files or a checkpoint go straight into the masters: until the store
    # binds them, the sub-models' parameters stay on meta (no second copy of the model)
    on_meta = state_dict is None and (files is not None or resume is not None)
    with parameters_on_meta() if on_meta else nullcontext():
        built = pkg.build_submodels()
    host_modules = [cast_floating(m, run.master_dtype) for m in built]
    if files is not None:
        files.load_buffers(pkg, host_modules)
    unread: list[str] = []
    if state_dict is not None:
        try:
            pkg.load_original_state_dict(host_modules, state_dict)
            unread = pkg.unread_names(state_dict)
        except KeyError as e:
            raise RuntimeMismatchError(
                f"the initial state dict lacks {e}, which {pkg.path} needs; give the original "
                f"model's state_dict()") from None
    return host_modules, unread


def start_executor(pkg: SwapPackage, host_modules: list[nn.Module], run: RunSettings,
                   plan: Plan | None, loss_fn: Callable[[Any, tuple], torch.Tensor],
                   offload_dirs: Sequence[str]) -> SwapExecutor:
    """The executor over `host_modules`, with its host store and CPU optimizer
    (SwapExecutor.assemble), once the host memory, the offload drives and (seeing the store
    before anything is allocated on it) the device are checked."""
    dev = run.device
    grad_slots = _grad_slots(plan, run)
    disk_kinds = _disk_kinds(plan, run)
    _check_host_memory(pkg, host_modules, run, plan, grad_slots,
                       disk_kinds)  # before any pinning
    drives = _offload_drives(offload_dirs, plan, disk_kinds)
    return SwapExecutor.assemble(
        pkg, host_modules, run.optimizer, device=dev, master_dtype=run.master_dtype,
        transfer_dtype=run.transfer_dtype, tracer=Tracer(dev, enabled=run.trace),
        scaler=LossScaler() if run.loss_scale else None, threaded=run.threaded_optimizer,
        param_order=_original_order(pkg),
        check_store=lambda store: _check_device_memory(dev, store, plan, run.capacity_bytes),
        grad_slots=grad_slots, disk_kinds=disk_kinds, drives=drives,
        written=_writing_progress(plan, disk_kinds),
        step=StepOptions(accum=run.accum, activations=run.activations,
                         offload_activations=run.offload_activations,
                         autocast_dtype=run.autocast, loss_fn=loss_fn, seed=run.seed,
                         tied_grads=run.tied_grads, early_prefetch=run.early_prefetch))


def _original_order(pkg: SwapPackage) -> list[str]:
    """Master keys in the order the original model lists its parameters.

    From the package's ORIGINAL_NAMES (what codegen writes), else PARAM_NAMES in sub-model
    order; never from the caller's state dict, so a resumed trainer sums norms in the same
    order as the run that wrote the checkpoint.
    """
    group = {}
    for key, holders in pkg.tied.items():
        for i, local in holders:
            group[pkg.param_names[i][local]] = key
        group[key] = key
    for names in pkg.param_names:
        for fqn in names.values():
            group.setdefault(fqn, fqn)
    names = pkg.original_names or tuple(fqn for names in pkg.param_names for fqn in names.values())
    return [group[k] for k in names if k in group]


def open_initial_weights(pkg: SwapPackage, weights: Any, state_dict: Any, resume: Any,
                  seed: int) -> Any:
    """The checkpoint files of weights= opened and checked against the package (headers
    only), with the initial values of adapter weights they lack; None without weights=."""
    if weights is None:
        return None
    if state_dict is not None:
        raise UsageError("give the initial weights as state_dict= or as weights= (checkpoint "
                         "files), not both")
    if resume is not None:
        raise UsageError("weights= gives the initial weights, checkpoint= resumes a run with "
                         "the weights it had; give one of them")
    from atomc.weights import open_weights
    files = open_weights(pkg, weights)
    files.take_initial(pkg, seed)
    return files


def check_plan(pkg: SwapPackage, plan: Any) -> dict[str, Any] | None:
    """The plan the package was generated for, as JSON data: given (and checked), or its plan.json.

    A package generated for another plan is refused. The data (not a Plan object) is kept, so
    that a plan written by an atomc with more or fewer IR fields still hashes as it was written.
    """
    if plan is None:
        beside = pkg.path / "plan.json"
        if not beside.is_file():
            return None
        data = read_json(beside, Plan.KIND)
        if canonical_hash(data) != pkg.plan_hash:
            raise RuntimeMismatchError(
                f"{beside} has hash {canonical_hash(data)}, but the package's code was generated "
                f"for plan {pkg.plan_hash}; the package was edited or mixed up: regenerate it "
                f"(atomc codegen)")
        return data
    if isinstance(plan, (str, Path)):
        source = str(plan)
        data = read_json(plan, Plan.KIND)
    else:
        source = "the plan given"
        data = plan.to_json()
    h = canonical_hash(data)
    if h != pkg.plan_hash:
        raise RuntimeMismatchError(
            f"{pkg.path} was generated for plan {pkg.plan_hash or '(none recorded)'}, but "
            f"{source} has hash {h}; regenerate the package from this plan (atomc codegen) or give "
            f"the plan it was generated from")
    if len(data.get("submodels", ())) != pkg.num_submodels:
        raise RuntimeMismatchError(f"{source} has {len(data.get('submodels', ()))} sub-models, "
                                   f"{pkg.path} has {pkg.num_submodels}; regenerate the package")
    return data


def check_device_memory(capacity_bytes: int, device_bytes: int, submodel_bytes: Sequence[int],
                        device_name: str, free_bytes: int | None = None) -> None:
    """Refuse a device the plan does not fit, naming the first sub-model that will not fit.

    `submodel_bytes[i]` is what sub-model i needs on the device while it computes (with the
    next one loading). The plan's budget must be within the device's memory (`device_bytes`),
    and, when `free_bytes` is given, every sub-model's need within the memory free now: other
    processes (or this one's tensors) may hold part of the device.
    """
    from atomc.units import format_bytes as fmt
    has = f"{device_name} has {fmt(device_bytes)} in total"
    if free_bytes is not None:
        has += f", {fmt(free_bytes)} of it free"
    if capacity_bytes > device_bytes:
        culprit = next((i for i, b in enumerate(submodel_bytes) if b > device_bytes), None)
        if culprit is None:
            culprit = max(range(len(submodel_bytes)), key=lambda i: submodel_bytes[i])
        raise RuntimeMismatchError(
            f"{has}, but the plan was made for {fmt(capacity_bytes)}; sub-model {culprit} needs "
            f"{fmt(submodel_bytes[culprit])} while it computes and will not fit: re-plan with "
            f"--gpu-mem {fmt(device_bytes)} or less")
    if free_bytes is None:
        return
    culprit = next((i for i, b in enumerate(submodel_bytes) if b > free_bytes), None)
    if culprit is not None:
        raise RuntimeMismatchError(
            f"{has}; sub-model {culprit} needs {fmt(submodel_bytes[culprit])} while it computes "
            f"and will not fit in the free memory: free device memory (other processes, tensors "
            f"held), or re-plan with --gpu-mem {fmt(free_bytes)} or less")


def _grad_slots(plan: Plan | None, run: Any) -> int | None:
    """The host gradient buffers a run takes in turn: the plan's ring, unless the run clips or
    scales its loss (every gradient must be in before any update) or has no plan (one buffer
    per sub-model, then)."""
    if run.optimizer.max_grad_norm is not None or run.loss_scale:
        return None
    host = plan.host if plan is not None else None
    return host.grad_slots if host is not None and host.grad_slots else None


def _disk_kinds(plan: Plan | None, run: Any) -> list[frozenset[str]]:
    """Per sub-model, the kinds of its states the plan keeps on disk (none without a plan, or
    for a plan of other dtypes than the run's: its placement was for those)."""
    host = plan.host if plan is not None else None
    if host is None or not host.disk_kinds:
        return []
    return [frozenset(k) for k in host.disk_kinds]


def _offload_drives(dirs: Sequence[str], plan: Plan | None,
                    disk_kinds: list[frozenset[str]]) -> list[Any]:
    """The offload directories checked (atomc.runtime.disk.check_dirs) where the plan keeps
    states on disk; refused in one line where it does and none is given."""
    if not any(disk_kinds):
        return []
    from atomc.runtime.disk import check_dirs
    from atomc.units import format_bytes

    assert plan is not None and plan.host is not None
    host = plan.host
    if not dirs:
        raise UsageError(
            f"the plan keeps {format_bytes(sum(host.disk_by_kind.values()))} of model states on "
            f"disk ({', '.join(sorted(host.disk_by_kind))}); give --offload-dir PATH, one "
            f"directory per NVMe drive, with {format_bytes(host.disk_need_bytes)} free")
    checks = check_dirs(dirs, host.disk_need_bytes)
    slow = [str(c.path) for c in checks if not c.direct]
    if slow:
        print(f"atomc: the file system of {', '.join(slow)} refuses direct I/O; the states go "
              f"through the page cache there (slower, and the kernel holds their pages)",
              file=sys.stderr)
    return checks


def _writing_progress(plan: Plan | None, disk_kinds: list[frozenset[str]]
                      ) -> Callable[[int], None] | None:
    """A progress line while the states are first written to disk, with how long it takes
    at the plan's rate."""
    if not any(disk_kinds) or plan is None or plan.host is None or plan.host.disk is None:
        return None
    from tqdm import tqdm

    from atomc.units import format_bytes

    host = plan.host
    total = sum(host.disk_by_kind.values())
    rate = host.disk.drives * host.disk.write_gbps * 1e9
    bar = tqdm(total=len(plan.submodels), unit=" sub-models",
               desc=(f"writing {format_bytes(total)} of states to disk (about "
                     f"{total / rate:.0f} s at {rate / 1e9:.1f} GB/s)"))

    def written(i: int) -> None:
        bar.update(1)
        if i == len(plan.submodels) - 1:
            bar.close()

    return written


def _check_host_memory(pkg: SwapPackage, host_modules: list[nn.Module], run: Any,
                       plan: Plan | None, grad_slots: int | None,
                       disk_kinds: list[frozenset[str]]) -> None:
    """Refuse in one line when the host store, the optimizer's moments and the activation
    stash (the plan's formula, atomc.partition.hostmem) exceed this machine's available
    memory; the weights already read count as available, since the store takes them over."""
    from atomc.partition import hostmem

    available = hostmem.available_host_bytes()
    if available is None:
        return  # no figure on this system: the run is not checked (as before this check)
    layouts = plan_layouts(pkg, host_modules, run.optimizer.decays,
                           transfer_dtype=run.transfer_dtype)
    stash = (hostmem.plan_stash_bytes(plan.submodels, run.accum, run.activations)
             if run.offload_activations and plan is not None else 0)
    # heavy operators' outputs the plan sends to host memory (atomc.runtime.opcache)
    sent = (hostmem.plan_sent_bytes(plan.submodels, run.accum)
            if run.activations == "auto" and plan is not None else 0)
    by_kind = planned_host_bytes(layouts, run.master_dtype, run.transfer_dtype,
                                 run.optimizer.states,
                                 stash_bytes=stash, sent_bytes=sent, grad_slots=grad_slots,
                                 disk_kinds=disk_kinds)
    held = sum(p.numel() * p.element_size() for m in host_modules for p in m.parameters()
               if not p.is_meta)
    frozen = any(not L.trainable_numel == L.owned_numel for L in layouts)
    hostmem.check_fits(by_kind, available + held, "atomc train: host memory (MemAvailable "
                       "plus the weights already read)", run.optimizer.states, frozen)


def _check_device_memory(dev: torch.device, store: HostStore, plan: Plan | None,
                         capacity: int | None) -> None:
    if dev.type != "cuda":
        return  # not enforced on the CPU
    free, total = torch.cuda.mem_get_info(dev)
    # memory this process's caching allocator holds but does not use is free for the executor too
    free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    k = len(store.layouts)
    slot_bytes = max(store.param_bytes(i) for i in range(k))
    # each sub-model computing with the next one loading; in the slots (an upper bound: its
    # gradients are in its peak and in the slots)
    if plan is not None:
        subs = plan.submodels
        slots = min(2, k) * 2 * max(sm.param_bytes for sm in subs)
        need = [max(sm.peak_bytes + (subs[i + 1].param_bytes if i + 1 < k else 0),
                    slots + sm.peak_bytes - sm.param_bytes)
                for i, sm in enumerate(subs)]
    else:  # weights and gradients of the two slots, at least
        need = [2 * (store.param_bytes(i) + slot_bytes) for i in range(k)]
    if capacity is None:
        capacity = max(need)
    check_device_memory(int(capacity), total, need, f"{dev} ({torch.cuda.get_device_name(dev)})",
                        free_bytes=free)
