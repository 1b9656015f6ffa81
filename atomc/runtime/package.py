"""Runtime stage, input side: a generated package directory -> a checked `SwapPackage`.

The generated-package contract (what `atomc codegen` writes; README "Generated packages"):
`SUBMODELS` (classes in order, each with `INPUTS` and `OUTPUTS` value names), `MODEL_INPUTS`,
`BOUNDARIES` (per sub-model {"inputs": {name: spec}, "outputs": {name: spec}}), `PLAN` (the
plan's hash and where it came from), `PARAM_NAMES` (per sub-model local name -> original FQN),
`TIED` (original FQN -> [(sub-model, local name), ...]), `build_submodels(device=None)`,
`load_original_state_dict(submodels, state_dict)`, `export_state_dict(submodels)`.

This module imports such a directory and checks that it keeps the contract, so that the
executor can rely on it: every value a sub-model reads is a model input or an earlier
sub-model's output, and every tied holder exists.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from atomc.codegen import load_package
from atomc.errors import CodegenError, ModelFileError, RuntimeMismatchError

REQUIRED = ("SUBMODELS", "MODEL_INPUTS", "BOUNDARIES", "PLAN", "PARAM_NAMES", "TIED",
            "build_submodels", "load_original_state_dict", "export_state_dict")


@dataclass(frozen=True)
class PackagePlan:
    """The generated package's PLAN: what it was cut for, read with types.

    Fields an older package lacks take these defaults (a package records no capacity when it
    was generated from a hand-made plan).
    """

    plan_hash: str = ""
    graph_hash: str = ""
    profile_hash: str = ""
    model_path: str = ""
    config: str | None = None
    batch_size: int = 0  # one micro-batch's samples
    options: dict[str, Any] = field(default_factory=dict)
    frontend: str = "fx"
    accum: int = 1
    activations: str = "recompute"  # "auto", "recompute" or "keep"
    device: str = ""
    capacity_bytes: int | None = None
    node_ranges: tuple[tuple[int, int], ...] = ()
    atomc_version: str = ""
    # the plan's dtypes ("" in older packages: planned for the model's dtype, no autocast)
    transfer_dtype: str = ""
    autocast: str = ""
    # per sub-model: (kept, sent) bytes of one micro-batch's heavy operator outputs
    activation_quotas: tuple[tuple[int, int], ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> PackagePlan:
        try:
            return cls(
                plan_hash=str(data.get("plan_hash") or ""),
                graph_hash=str(data.get("graph_hash") or ""),
                profile_hash=str(data.get("profile_hash") or ""),
                model_path=str(data.get("model_path") or ""),
                config=None if data.get("config") is None else str(data["config"]),
                batch_size=int(data.get("batch_size") or 0),
                options=dict(data.get("options") or {}),
                frontend=str(data.get("frontend") or "fx"),
                accum=int(data.get("accum") or 1),
                activations=str(data.get("activations") or "recompute"),
                device=str(data.get("device") or ""),
                capacity_bytes=(None if data.get("capacity_bytes") is None
                                else int(data["capacity_bytes"])),
                node_ranges=tuple((int(a), int(b)) for a, b in data.get("node_ranges") or ()),
                atomc_version=str(data.get("atomc_version") or ""),
                transfer_dtype=str(data.get("transfer_dtype") or ""),
                autocast=str(data.get("autocast") or ""),
                activation_quotas=tuple((int(k), int(s))
                                        for k, s in data.get("activation_quotas") or ()),
            )
        except (TypeError, ValueError) as e:
            raise RuntimeMismatchError(f"{source}: PLAN has a field of the wrong type ({e}); the "
                                       f"package is damaged, regenerate it") from None


@dataclass
class SwapPackage:
    path: Path
    module: ModuleType
    classes: list[type]
    model_inputs: tuple[str, ...]
    inputs: list[tuple[str, ...]]  # per sub-model, value names in forward() order
    outputs: list[tuple[str, ...]]
    boundaries: list[dict[str, Any]]
    plan: PackagePlan
    param_names: list[dict[str, str]]
    tied: dict[str, list[tuple[int, str]]]
    build_submodels: Callable[..., list]
    load_original_state_dict: Callable[..., Any]
    export_state_dict: Callable[..., dict]
    original_names: tuple[str, ...] = ()  # the original state-dict names, in the model's order
    full_precision: tuple[str, ...] = ()  # weights kept float32 in half-precision runs (norms)
    # names -> torch's state-dict `_metadata` (module format versions); None in packages from
    # before atomc recorded them
    state_dict_metadata: Callable[..., dict] | None = None

    @functools.cached_property
    def _grad_inputs(self) -> tuple[frozenset[str], ...]:
        out = []
        for boundary in self.boundaries:
            out.append(frozenset(
                name for name, spec in boundary.get("inputs", {}).items()
                if spec.get("grad", str(spec.get("dtype", "")).startswith(
                    ("float", "bfloat", "complex")))))
        return tuple(out)

    def grads_at(self, i: int) -> frozenset[str]:
        """The boundary values that take a gradient as sub-model i receives them (BOUNDARIES'
        "grad", from atomc.trace.grad_values, as it holds at the cut before i): the only ones
        a runtime makes leaves that take gradients. It depends on the cut: a value made without
        gradients and filled in place later takes one only at the cuts after the first write.
        A package from before atomc recorded it: every floating tensor, as then."""
        return self._grad_inputs[i] if i < len(self._grad_inputs) else frozenset()

    def carries_grad(self, name: str, i: int) -> bool:
        """Whether the boundary value `name`, as sub-model i receives it, takes a gradient (the
        one rule of every runtime that receives boundary values as autograd leaves)."""
        return name in self.grads_at(i)

    def unread_names(self, state_dict: dict[str, Any]) -> list[str]:
        """Names in an original state dict that no sub-model holds (weights the traced graph
        never reads), as the package's `load_original_state_dict` returns them."""
        held = {fqn for names in self.param_names for fqn in names.values()}
        aliases = getattr(self.module, "ALIASES", {})
        return [k for k in state_dict if aliases.get(k, k) not in held]

    @property
    def num_submodels(self) -> int:
        return len(self.classes)

    @property
    def plan_hash(self) -> str:
        return self.plan.plan_hash

    def readers(self) -> dict[str, list[int]]:
        """Value name -> indices of the sub-models that read it, ascending."""
        out: dict[str, list[int]] = {}
        for i, names in enumerate(self.inputs):
            for n in names:
                out.setdefault(n, []).append(i)
        return out

    def producers(self) -> dict[str, int]:
        """Value name -> index of the sub-model that produces it (-1: a model input)."""
        out = dict.fromkeys(self.model_inputs, -1)
        for i, names in enumerate(self.outputs[:-1]):
            for n in names:
                out[n] = i
        return out

    def input_specs(self) -> dict[str, dict[str, Any]]:
        """Model input name -> {"shape", "dtype"} as the plan saw it (one micro-batch)."""
        specs: dict[str, dict[str, Any]] = {}
        for b in self.boundaries:
            for name, spec in (b.get("inputs") or {}).items():
                if name in self.model_inputs and name not in specs:
                    specs[name] = spec
        return specs

    def model_file(self) -> Path | None:
        """The model file the package was generated from, if it can be found.

        A relative PLAN["model_path"] is tried from the working directory, then beside the
        package and beside its parent directory.
        """
        raw = self.plan.model_path
        if not raw:
            return None
        p = Path(raw)
        candidates = [p] if p.is_absolute() else [p, self.path / p, self.path.parent / p,
                                                   self.path.parent.parent / p]
        return next((c for c in candidates if c.is_file()), None)

    def initial_state_dict(self, seed: int) -> dict[str, Any] | None:
        """The original model's weights as its build_model() makes them under manual_seed(seed);
        None when the model file is not found (the sub-models' own initialisation is used)."""
        path = self.model_file()
        if path is None:
            return None
        import torch

        from atomc.trace.load import call_with_options, load_model_file
        module = load_model_file(path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = call_with_options(module.build_model, (self.plan.config,),
                                      dict(self.plan.options), path)
        return model.state_dict()

    def model_module(self) -> ModuleType:
        """The imported model file; ModelFileError when it is not found from here."""
        path = self.model_file()
        if path is None:
            raise ModelFileError(f"{self.path} was generated from model file "
                                 f"{self.plan.model_path!r}, which is not found from here; run "
                                 f"from the directory the plan was made in, or pass loss_fn= "
                                 f"(and state_dict= for the initial weights)")
        from atomc.trace import load_model_file
        return load_model_file(path)

    def model_loss_fn(self) -> Callable:
        """The model file's loss_fn(outputs, batch); ModelFileError when there is none."""
        fn = getattr(self.model_module(), "loss_fn", None)
        if not callable(fn):
            raise ModelFileError(f"{self.model_file()} defines no loss_fn(outputs, batch); add "
                                 f"one or pass loss_fn=")
        return fn

    def fingerprint(self) -> str:
        """Hash of the package's structure: what a checkpoint must agree with."""
        data = repr((self.plan_hash, self.model_inputs, self.inputs, self.outputs,
                     sorted((i, sorted(n.items())) for i, n in enumerate(self.param_names)),
                     sorted((k, sorted(v)) for k, v in self.tied.items())))
        return hashlib.sha256(data.encode()).hexdigest()[:16]


def import_package(path: str | Path) -> ModuleType:
    try:
        return load_package(path)
    except CodegenError as e:
        raise RuntimeMismatchError(str(e)) from e


def load_swap_package(path: str | Path) -> SwapPackage:
    p = Path(path)
    module = import_package(p)
    missing = [n for n in REQUIRED if not hasattr(module, n)]
    if missing:
        raise RuntimeMismatchError(
            f"{p} lacks {', '.join(missing)}: not a package `atomc codegen` wrote (or an older "
            f"one); regenerate it")
    classes = list(module.SUBMODELS)
    k = len(classes)
    for attr in ("BOUNDARIES", "PARAM_NAMES"):
        if len(getattr(module, attr)) != k:
            raise RuntimeMismatchError(f"{p}: {attr} has {len(getattr(module, attr))} entries for "
                                       f"{k} sub-models; the package is damaged, regenerate it")
    if k == 0:
        raise RuntimeMismatchError(f"{p} has no sub-models; regenerate it")
    inputs, outputs = [], []
    for i, cls in enumerate(classes):
        if not hasattr(cls, "INPUTS") or not hasattr(cls, "OUTPUTS"):
            raise RuntimeMismatchError(f"{p}: sub-model {i} ({cls.__name__}) lacks INPUTS/OUTPUTS")
        inputs.append(tuple(cls.INPUTS))
        outputs.append(tuple(cls.OUTPUTS))
    model_inputs = tuple(module.MODEL_INPUTS)
    available = set(model_inputs)
    for i in range(k):
        unknown = [n for n in inputs[i] if n not in available]
        if unknown:
            raise RuntimeMismatchError(
                f"{p}: sub-model {i} reads {', '.join(unknown)}, which no model input or earlier "
                f"sub-model produces; the package is damaged, regenerate it")
        available.update(outputs[i])
    tied: dict[str, list[tuple[int, str]]] = {}
    for fqn, holders in dict(module.TIED).items():
        pairs = [(int(i), str(n)) for i, n in holders]
        for i, n in pairs:
            if not 0 <= i < k or n not in module.PARAM_NAMES[i]:
                raise RuntimeMismatchError(f"{p}: TIED[{fqn!r}] names sub-model {i} parameter "
                                           f"{n!r}, which PARAM_NAMES does not list; regenerate "
                                           f"the package")
        tied[fqn] = pairs
    return SwapPackage(
        path=p, module=module, classes=classes, model_inputs=model_inputs, inputs=inputs,
        outputs=outputs, boundaries=list(module.BOUNDARIES),
        plan=PackagePlan.from_dict(dict(module.PLAN), str(p)),
        param_names=[dict(d) for d in module.PARAM_NAMES], tied=tied,
        build_submodels=module.build_submodels,
        load_original_state_dict=module.load_original_state_dict,
        export_state_dict=module.export_state_dict,
        original_names=tuple(getattr(module, "ORIGINAL_NAMES", ())),
        full_precision=tuple(getattr(module, "FULL_PRECISION", ())),
        state_dict_metadata=getattr(module, "state_dict_metadata", None),
    )
