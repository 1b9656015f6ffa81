"""Runtime stage, settings: what a user may choose for a swap run, and the one step that turns
those choices into the settings a run uses.

`TrainerConfig` holds the choices as given (None: "the plan's" or "the default"). `resolve`
fills every None from the plan the package was generated for, the package's PLAN, a checkpoint
being resumed and the initial weights, checks the combination, and returns `RunSettings`,
where nothing is left open. SwapTrainer.from_package, peers and the CLI build the same config,
so a default is decided in one place.

`read_settings_file(path, options)` reads a command's options from a TOML file (`atomc train
--config run.toml`), each checked as the command line checks it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from atomc.device import parse_device
from atomc.dtypes import dtype_from_name, dtype_name, parse_dtype
from atomc.errors import AtomcError, UsageError
from atomc.ir import Plan
from atomc.runtime.optim import AdamWConfig, updates_on_a_thread
from atomc.runtime.package import PackagePlan, SwapPackage

_HALF = (torch.float16, torch.bfloat16)

# auto: the plan's per-operator policy (atomc.runtime.opcache); recompute, keep: the extremes
ACTIVATIONS = ("auto", "recompute", "keep")


@dataclass(frozen=True)
class TrainerConfig:
    """A swap run's choices (see SwapTrainer.from_package for what each one means)."""

    device: str | torch.device | None = None  # default: cuda when available
    accum: int | None = None  # C; default: the plan's
    optimizer: AdamWConfig | dict[str, Any] | None = None
    activations: str | None = None  # "recompute" or "keep"; default: the plan's
    offload_activations: bool | None = None  # default: when the plan streams checkpoints
    dtype: str | torch.dtype | None = None  # master dtype
    transfer_dtype: str | torch.dtype | None = None  # the device copy's dtype
    autocast: str | torch.dtype | None = None
    loss_scale: bool | None = None
    gpu_mem: int | None = None  # bytes; default: the plan's capacity
    trace: bool = False
    tied_grads: str = "fast"  # or "exact"
    threaded_optimizer: bool | None = None  # None: optim.updates_on_a_thread(device)
    seed: int = 0
    # directories on NVMe drives (one per drive) for the states the plan puts on disk
    offload_dirs: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: TrainerConfig | dict[str, Any] | None,
           options: dict[str, Any]) -> TrainerConfig:
        """`config` (a TrainerConfig or a dict of its fields) with `options` over it."""
        if config is None:
            config = cls()
        elif isinstance(config, dict):
            options = {**config, **options}
            config = cls()
        elif not isinstance(config, cls):
            raise UsageError(f"config is a {type(config).__name__}; give a TrainerConfig or a dict "
                             f"of its fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UsageError(f"unknown trainer option{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(unknown)}; the options are {', '.join(sorted(known))}")
        return dataclasses.replace(config, **options)

    def resolve(self, pkg: SwapPackage, plan: Plan | None, *,
                resume: dict[str, Any] | None = None,
                initial: dict[str, Any] | None = None) -> RunSettings:
        """Every choice made: from this config, else `plan`, else the package's PLAN, else the
        defaults. `resume` is the checkpoint being resumed, `initial` the initial weights;
        they decide the master dtype when none is given."""
        accum = int(self.accum if self.accum is not None else pkg.plan.accum)
        if accum < 1:
            raise UsageError(f"accum {accum} must be 1 or more")
        activations = self.activations or pkg.plan.activations
        if activations not in ACTIVATIONS:
            raise UsageError(f"activations={activations!r}: choose one of "
                             f"{', '.join(ACTIVATIONS)}")
        if self.tied_grads not in ("fast", "exact"):
            raise UsageError(f"tied_grads={self.tied_grads!r}: choose fast or exact")

        master = parse_dtype(self.dtype, "dtype")
        if master is None and resume is not None and "master_dtype" in resume:
            master = parse_dtype(str(resume["master_dtype"]), "checkpoint master dtype")
        if master is None and initial is not None:
            floats = {t.dtype for t in initial.values()
                      if isinstance(t, torch.Tensor) and t.is_floating_point()}
            master = torch.float64 if floats == {torch.float64} else None
        master = master or torch.float32
        if master not in (torch.float32, torch.float64):
            raise UsageError(f"master dtype {master} is not float32 or float64; half-precision "
                             f"weights go to the device with transfer_dtype=, masters stay float32")
        transfer, autocast = self.dtypes_for(master, plan if plan is not None else pkg.plan)
        loss_scale = self.loss_scale
        if loss_scale is None:  # float16 gradients underflow without it, from weights or compute
            loss_scale = torch.float16 in (transfer, autocast)

        offload = self.offload_activations
        if offload is None:  # the plan's memory model streams checkpoints when it costs them
            offload = activations != "keep" and plan is not None and any(
                sm.checkpoint_ms > 0 for sm in plan.submodels[:-1])
        elif offload and activations == "keep":
            raise UsageError("offload_activations=True needs activations 'auto' or 'recompute': "
                             "with 'keep' the autograd graphs hold every saved activation on "
                             "the device")
        capacity = self.gpu_mem
        if capacity is None:
            capacity = plan.capacity_bytes if plan is not None else pkg.plan.capacity_bytes
        device = parse_device(self.device)
        threaded = self.threaded_optimizer
        if threaded is None:
            threaded = updates_on_a_thread(device)
        return RunSettings(
            device=device, accum=accum, micro_batch=pkg.plan.batch_size,
            activations=activations, offload_activations=bool(offload), master_dtype=master,
            transfer_dtype=transfer, autocast=autocast, loss_scale=bool(loss_scale),
            optimizer=AdamWConfig.coerce(self.optimizer), capacity_bytes=capacity,
            trace=self.trace, tied_grads=self.tied_grads,
            threaded_optimizer=threaded, seed=self.seed,
            early_prefetch=bool(plan is not None and plan.early_prefetch))

    def dtypes_for(self, master: torch.dtype,
                planned: Plan | PackagePlan) -> tuple[torch.dtype, torch.dtype | None]:
        """(transfer, autocast): given, else the plan's, else the defaults. A plan made by
        `atomc partition` records the dtypes its memory was sized for; running it with others
        is refused (a hand-made plan or an older package records none)."""
        given_transfer = parse_dtype(self.transfer_dtype, "transfer dtype")
        given_autocast = parse_dtype(self.autocast, "autocast dtype")
        if not planned.transfer_dtype:  # no dtypes recorded: nothing to hold the run to
            transfer = given_transfer or master
            autocast = given_autocast
            if autocast is None and transfer in _HALF:
                autocast = transfer
            return transfer, autocast
        plan_transfer = dtype_from_name(planned.transfer_dtype, "the plan's transfer dtype")
        plan_autocast = (dtype_from_name(planned.autocast, "the plan's autocast dtype")
                         if planned.autocast else None)
        half_plan = plan_transfer in _HALF
        transfer = given_transfer or (plan_transfer if half_plan else master)
        if (half_plan and transfer != plan_transfer) or (not half_plan and transfer in _HALF):
            raise UsageError(
                f"transfer dtype {dtype_name(transfer)}: this plan's memory and transfers were "
                f"planned for {planned.transfer_dtype} weights and gradients on the GPU; drop "
                f"the option to run as planned, or partition again with --transfer-dtype "
                f"{dtype_name(transfer)}")
        autocast = given_autocast or plan_autocast
        if autocast != plan_autocast:
            planned_as = (f"autocast {planned.autocast}" if planned.autocast
                          else "no autocast")
            again = (f"--autocast {dtype_name(autocast)}" if autocast is not None
                     else "--autocast none")
            raise UsageError(
                f"autocast {dtype_name(autocast) if autocast is not None else 'off'}: this "
                f"plan's activations were sized for {planned_as}; drop the option to run as "
                f"planned, or partition again with {again}")
        return transfer, autocast


@dataclass(frozen=True)
class RunSettings:
    """A TrainerConfig with every choice made (TrainerConfig.resolve)."""

    device: torch.device
    accum: int
    micro_batch: int  # samples per micro-batch, as planned
    activations: str
    offload_activations: bool
    master_dtype: torch.dtype
    transfer_dtype: torch.dtype
    autocast: torch.dtype | None
    loss_scale: bool
    optimizer: AdamWConfig
    capacity_bytes: int | None  # checked against a CUDA device; None: no plan recorded one
    trace: bool
    tied_grads: str
    threaded_optimizer: bool
    seed: int
    early_prefetch: bool


# ---- a settings file for a command ---------------------------------------------------------------


def _toml_module() -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser, as the tomli package
        try:
            import tomli as tomllib
        except ImportError:
            raise UsageError("reading a TOML settings file on Python 3.10 needs the tomli "
                             "package: pip install tomli") from None
    return tomllib


def _setting(path: str, key: str, value: Any, action: argparse.Action) -> Any:
    """`value` from the file as the option's own parser would turn its text into a value."""
    flag = action.nargs == 0  # store_true / store_false / store_const
    many = (action.nargs in ("+", "*") or isinstance(action.nargs, int)
            or isinstance(action, argparse._AppendAction))
    what = ("true or false" if flag else
            f"one of {', '.join(map(str, action.choices))}" if action.choices else
            "a list" if many else
            getattr(action.type, "__name__", "a string") if action.type else "a string")

    def bad(reason: str = "") -> UsageError:
        return UsageError(f"{path}: {key} = {value!r}{f' ({reason})' if reason else ''}; "
                          f"expected {what}")

    if flag:
        if not isinstance(value, bool):
            raise bad()
        return value
    if isinstance(value, dict):
        raise bad("a table: the file is flat, one `key = value` per option")
    if isinstance(action, argparse._AppendAction) and not isinstance(value, list):
        value = [value]  # given once, as on the command line
    items = value if many else [value]
    if not isinstance(items, list) or (not many and isinstance(value, list)):
        raise bad()
    out = []
    for item in items:
        if isinstance(item, bool) or isinstance(item, (dict, list)):
            raise bad()
        if action.type is None:
            if not isinstance(item, str):
                raise bad()
            converted = item
        else:
            try:
                converted = action.type(item if isinstance(item, str) else str(item))
            except (TypeError, ValueError, argparse.ArgumentTypeError, AtomcError) as e:
                raise bad(str(e)) from None
        if action.choices is not None and converted not in action.choices:
            raise bad()
        out.append(converted)
    return out if many else out[0]


def read_settings_file(path: str | Path, options: dict[str, argparse.Action]) -> dict[str, Any]:
    """The settings in a TOML file, `key = value` for each option a command has (`options`:
    the option's dest -> its argparse action; a key may spell `-` for `_`), each value checked
    and converted by the option's own type and choices. UsageError for a file that is not
    TOML, an unknown key (with the list of known ones) or a bad value."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = _toml_module().load(f)
    except FileNotFoundError:
        raise UsageError(f"settings file {p} does not exist; give a TOML file of "
                         f"`option = value` lines") from None
    except OSError as e:
        raise UsageError(f"cannot read settings file {p} ({e.strerror or e})") from None
    except ValueError as e:  # tomllib.TOMLDecodeError
        raise UsageError(f"settings file {p} is not TOML ({e}); write one `option = value` "
                         f"a line, e.g. lr = 3e-4") from None
    settings: dict[str, Any] = {}
    for key, value in data.items():
        dest = key.replace("-", "_")
        if dest not in options:
            raise UsageError(f"{p}: unknown key {key!r}; the keys are "
                             f"{', '.join(sorted(options))}")
        settings[dest] = _setting(str(p), key, value, options[dest])
    return settings
