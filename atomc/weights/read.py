"""Weights in: a checkpoint on disk -> a trainer's host store, one tensor at a time.

Formats: safetensors (one file, or shards with `model.safetensors.index.json`, as Hugging Face
models ship) and PyTorch state dicts (`.bin`/`.pt`/`.pth`, one file or shards with
`pytorch_model.bin.index.json`). A path is a file or a directory holding one of those.

Memory: only the headers (and index) are read up front. Each tensor is then read on its own:
a safetensors file is opened with `safe_open` (memory-mapped) and a PyTorch file with
`torch.load(mmap=True, weights_only=True)` for that one tensor, and closed again after it was
copied into its master, so the mapped pages of at most one tensor are resident at a time and
the peak is the host store plus one tensor (two when the file's dtype is not the master's:
the cast's source). Nothing builds the original model with real weights, except for the
weights of a peft adapter that the checkpoint does not have: their initial values come from
the model file's `build_model()`, built once before the store is allocated.

Names: each path's tensor names are matched against the conventions of atomc.weights.names;
the one that names most of them is the path's. A tensor that no convention names, a weight of
the package that no path holds, or a tensor whose shape is not the weight's is refused with
one line naming it (RuntimeMismatchError), before the store is allocated.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atomc.errors import RuntimeMismatchError, UsageError
from atomc.weights.names import (
    ORIGINAL,
    PEFT,
    TRANSFORMERS,
    ModelNames,
    SwapPackageLike,
    package_names,
)

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# what a directory is searched for, in this order
DIRECTORY_FILES = (SAFETENSORS_INDEX, "model.safetensors", BIN_INDEX, "pytorch_model.bin",
                   "adapter_model.safetensors", "adapter_model.bin")
TORCH_SUFFIXES = (".bin", ".pt", ".pth")

# safetensors' dtype names (the header's "dtype") -> torch dtypes
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def require(module: str) -> Any:
    """An optional package the checkpoint formats need (both come with transformers)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"safetensors checkpoints need the {module} package: pip install "
                         f"'atomc[hf]' (with your torch pinned in the same command)") from None


@dataclass(frozen=True)
class Stored:
    """Where one tensor of a checkpoint is, and what it is (from the file's header)."""

    file: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class CheckpointFiles:
    """The tensors of one checkpoint (a file or a directory): name -> `Stored`, read from the
    headers and the index only; `copy_into` and `read` read one tensor each."""

    def __init__(self, path: Path, tensors: dict[str, Stored]):
        self.path = path
        self.tensors = tensors

    @classmethod
    def open(cls, path: str | Path) -> CheckpointFiles:
        p = Path(path)
        files = _checkpoint_files(p)
        tensors: dict[str, Stored] = {}
        for f, keys in files:
            for s in _headers(f):
                if keys is not None and s.key not in keys:
                    continue  # the index gives this tensor to another shard
                if s.key in tensors:
                    raise RuntimeMismatchError(f"{p}: tensor {s.key!r} is in both "
                                               f"{tensors[s.key].file.name} and {f.name}; the "
                                               f"checkpoint is damaged: give an intact one")
                tensors[s.key] = s
            if keys is not None:
                absent = sorted(set(keys) - set(tensors))
                if absent:
                    raise RuntimeMismatchError(
                        f"{p}: the index places {absent[0]!r} in {f.name}, which does not hold "
                        f"it{f' (nor {len(absent) - 1} more)' if len(absent) > 1 else ''}; the "
                        f"checkpoint is damaged or incomplete: download it again")
        if not tensors:
            raise RuntimeMismatchError(f"{p} holds no tensors; give a checkpoint with the "
                                       f"model's weights")
        return cls(p, tensors)

    def copy_into(self, name: str, target: torch.Tensor) -> None:
        """Copy tensor `name` into `target` (cast to its dtype), reading only that tensor."""
        with _opened(self.tensors[name]) as t:
            target.copy_(t)

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` as a tensor of its own (for the few the store does not hold)."""
        with _opened(self.tensors[name]) as t:
            return t.detach().clone()


class _opened:
    """One tensor of a checkpoint, from a file opened for it alone (closed on exit)."""

    def __init__(self, s: Stored):
        self.s = s
        self._file: Any = None

    def __enter__(self) -> torch.Tensor:
        s = self.s
        if s.file.suffix == ".safetensors":
            self._file = require("safetensors").safe_open(str(s.file), framework="pt",
                                                          device="cpu")
            self._file.__enter__()
            return self._file.get_tensor(s.key)
        return _torch_state(s.file)[s.key]

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.__exit__(*exc)
        self._file = None


def _checkpoint_files(p: Path) -> list[tuple[Path, set[str] | None]]:
    """(file, the names the index gives it, or None for all) of a checkpoint path."""
    if p.is_dir():
        found = next((p / n for n in DIRECTORY_FILES if (p / n).is_file()), None)
        if found is None:
            candidates = sorted([*p.glob("*.safetensors.index.json"), *p.glob("*.bin.index.json"),
                                 *p.glob("*.safetensors"),
                                 *(f for s in TORCH_SUFFIXES for f in p.glob(f"*{s}"))])
            indexes = [c for c in candidates if c.name.endswith(".index.json")]
            if len(indexes) == 1:
                found = indexes[0]
            elif len(candidates) == 1:
                found = candidates[0]
            else:
                listed = ", ".join(c.name for c in candidates[:4])
                listed += ", ..." if len(candidates) > 4 else ""
                what = f"{len(candidates)} candidates: {listed}" if candidates else "none"
                raise RuntimeMismatchError(
                    f"{p} holds no checkpoint atomc can tell apart ({what}); expected "
                    f"{SAFETENSORS_INDEX}, model.safetensors, {BIN_INDEX} or pytorch_model.bin "
                    f"(or a single .safetensors/.bin/.pt file): give the checkpoint file itself")
        p = found
    if not p.is_file():
        raise RuntimeMismatchError(f"checkpoint {p} does not exist; give a directory with "
                                   f"{SAFETENSORS_INDEX} or model.safetensors, or a "
                                   f".safetensors/.bin/.pt file")
    if p.name.endswith(".index.json"):
        return _index_files(p)
    if p.suffix != ".safetensors" and p.suffix not in TORCH_SUFFIXES:
        raise RuntimeMismatchError(f"{p} is not a checkpoint format atomc reads (suffix "
                                   f"{p.suffix or 'none'}); expected .safetensors, .bin, .pt or "
                                   f"a *.index.json of shards")
    return [(p, None)]


def _index_files(index: Path) -> list[tuple[Path, set[str] | None]]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeMismatchError(f"{index} is not a checkpoint index ({type(e).__name__}: "
                                   f"{e}); expected JSON with a \"weight_map\" of tensor name -> "
                                   f"shard file, as Hugging Face writes it") from None
    by_file: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(str(file), set()).add(str(name))
    out = []
    for file, names in by_file.items():
        shard = index.parent / file
        if not shard.is_file():
            raise RuntimeMismatchError(f"{index} names shard {file}, which is not in "
                                       f"{index.parent}; the checkpoint is incomplete: download "
                                       f"every shard")
        out.append((shard, names))
    return out


def _headers(f: Path) -> list[Stored]:
    if f.suffix == ".safetensors":
        safetensors = require("safetensors")
        try:
            with safetensors.safe_open(str(f), framework="pt", device="cpu") as h:
                out = []
                for k in h.keys():
                    sl = h.get_slice(k)
                    dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise RuntimeMismatchError(f"{f}: tensor {k!r} has dtype "
                                                   f"{sl.get_dtype()}, which atomc cannot train "
                                                   f"from; convert the checkpoint")
                    out.append(Stored(f, k, tuple(sl.get_shape()), dtype))
                return out
        except safetensors.SafetensorError as e:
            raise RuntimeMismatchError(f"{f} is not a readable safetensors file ({e}); give an "
                                       f"intact checkpoint") from None
    state = _torch_state(f)
    return [Stored(f, k, tuple(t.shape), t.dtype) for k, t in state.items()]


def _torch_state(f: Path) -> dict[str, torch.Tensor]:
    """A PyTorch state-dict file, memory-mapped (its tensors' bytes are read when touched)."""
    try:
        state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure: re-raised as a user error
        raise RuntimeMismatchError(
            f"{f} does not load as a PyTorch state dict with torch.load(mmap=True, "
            f"weights_only=True) ({type(e).__name__}: {str(e).splitlines()[0][:200]}); give a "
            f"file written by torch.save(model.state_dict()) (or a .safetensors file)") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise RuntimeMismatchError(f"{f} holds a {type(state).__name__}, not a state dict (names "
                                   f"-> tensors); give torch.save(model.state_dict())'s file")
    return state


# ---------------------------------------------------------------------------------------------
# a package's weights from checkpoints


@dataclass
class WeightsIn:
    """Where each weight of a package comes from; checked, nothing read yet (`open_weights`)."""

    names: ModelNames
    sources: list[CheckpointFiles]
    held: dict[str, tuple[CheckpointFiles, str]]  # held name -> (checkpoint, its tensor name)
    unread: dict[str, tuple[CheckpointFiles, str]]  # weights no sub-model holds (carried along)
    from_model: list[str] = field(default_factory=list)  # adapter weights the files lack
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # their values

    def dtypes(self) -> dict[str, torch.Tensor]:
        """Stand-ins (no memory) with the dtype of each weight the files hold, for choosing
        the master dtype (adapter weights they lack take the files' dtype)."""
        return {n: torch.empty(0, dtype=ck.tensors[k].dtype, device="meta")
                for n, (ck, k) in self.held.items()}

    def take_initial(self, pkg: SwapPackageLike, seed: int) -> None:
        """Values of the adapter weights that no file holds: the model file's initialisation
        under `seed` (as build_model() makes them for a trainer without weights=)."""
        if not self.from_model:
            return
        state = pkg.initial_state_dict(seed)
        if state is None:
            raise RuntimeMismatchError(
                f"{', '.join(s.path.name for s in self.sources)} lacks the adapter weights "
                f"{self.from_model[0]!r}{_more(self.from_model)}, and the model file "
                f"{pkg.plan.model_path!r} that would initialise them is not found from here; "
                f"run from the directory the plan was made in, or give the adapter too")
        self.initial = {n: state[n].detach().clone() for n in self.from_model}
        del state

    def load_buffers(self, pkg: SwapPackageLike, modules: list[nn.Module]) -> None:
        """Persistent buffers (running statistics, counters) into the host sub-models."""
        with torch.no_grad():
            for mod, names in zip(modules, pkg.param_names):
                for local, buf in list(mod.named_buffers(remove_duplicate=False)):
                    fqn = names.get(local)
                    if fqn is None:
                        continue
                    if buf.device.type == "meta":  # no constructor value: the file gives it
                        owner, _, leaf = local.rpartition(".")
                        real = torch.empty(buf.shape, dtype=buf.dtype)
                        (mod.get_submodule(owner) if owner else mod)._buffers[leaf] = real
                        buf = real
                    self._copy(fqn, buf)

    def load_masters(self, store: Any) -> dict[str, torch.Tensor]:
        """Every owned master of `store` (a HostStore) from its file, tensor by tensor; then
        the device images. Returns the weights no sub-model holds, read into memory."""
        with torch.no_grad():
            for i, layout in enumerate(store.layouts):
                # tensor by tensor, each read when the pass reaches it (where the states are
                # on disk: a segment at a time, one pass over the sub-model)
                dtype = store.master_dtype
                store.write_entries(i, [(e, lambda e=e, d=dtype: self._read(e.key, e.shape, d))
                                        for e in layout.entries if e.owned])
        for i in range(len(store.layouts)):
            store.refresh_replicas(i)
        return {n: ck.read(k) for n, (ck, k) in self.unread.items()}

    def _read(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        target = torch.empty(shape, dtype=dtype)
        self._copy(name, target)
        return target

    def _copy(self, name: str, target: torch.Tensor) -> None:
        if name in self.initial:
            target.copy_(self.initial[name])
            return
        ck, key = self.held[name]
        ck.copy_into(key, target)


def open_weights(pkg: SwapPackageLike, paths: str | Path | Sequence[str | Path]) -> WeightsIn:
    """Open the checkpoint(s) at `paths` for the package and check them against its weights
    (names, shapes); one line names the first mismatch. Reads headers only."""
    many = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not many:
        raise RuntimeMismatchError("weights= names no checkpoint; give a checkpoint directory "
                                   "or file")
    sources = [CheckpointFiles.open(p) for p in many]
    modules = pkg.build_submodels(device="meta")  # shapes only
    names = package_names(pkg, modules)
    held: dict[str, tuple[CheckpointFiles, str]] = {}
    unread: dict[str, tuple[CheckpointFiles, str]] = {}
    model_names = set(names.model_names)
    for ck in sources:
        convention, mapping = _convention(names, ck, pkg)
        unexpected = [k for k in ck.tensors
                       if k not in mapping and not names.ignorable(convention, k)]
        if unexpected:
            raise RuntimeMismatchError(
                f"{ck.path} has tensor {unexpected[0]!r}{_more(unexpected)}, which the model of "
                f"{pkg.path} does not have (it names its weights like "
                f"{_example(names, convention)!r} in such a checkpoint): a checkpoint of another "
                f"model; give the checkpoint of the model the package was generated from")
        # a tied weight given under two names is read from its held name
        ordered = sorted((k for k in ck.tensors if k in mapping),
                         key=lambda k: names.canonical(mapping[k]) != mapping[k])
        for key in ordered:
            original = mapping[key]
            name = names.canonical(original)
            if name in names.shapes:
                if name in held:
                    if held[name][0] is not ck:
                        raise RuntimeMismatchError(
                            f"{name} is in both {held[name][0].path} and {ck.path}; give each "
                            f"weight once")
                    continue
                _check_shape(ck, key, name, names.shapes[name])
                held[name] = (ck, key)
            elif original in model_names:
                unread.setdefault(original, (ck, key))
    missing = [n for n in names.held if n not in held]
    from_model = [n for n in missing if n in names.adapter]
    missing = [n for n in missing if n not in names.adapter]
    if missing:
        where = " and ".join(str(ck.path) for ck in sources)
        hint = _file_name(names, missing[0])
        raise RuntimeMismatchError(
            f"{where} lacks weight {missing[0]!r}{hint}{_more(missing)} of the model of "
            f"{pkg.path}; give the model's whole checkpoint (every shard, with its index)")
    return WeightsIn(names, sources, held, unread, from_model)


def _convention(names: ModelNames, ck: CheckpointFiles,
                pkg: SwapPackageLike) -> tuple[str, dict[str, str]]:
    """The convention that names most of the checkpoint's tensors, and its map."""
    best, best_hits = ORIGINAL, -1
    for convention in (ORIGINAL, TRANSFORMERS, PEFT):
        mapping = names.conventions.get(convention)
        if mapping is None:
            continue
        hits = sum(1 for k in ck.tensors if k in mapping)
        if hits > best_hits:
            best, best_hits = convention, hits
    if best_hits <= 0:
        first = next(iter(ck.tensors))
        known = " or ".join(f"{_example(names, c)!r}" for c in names.conventions)
        raise RuntimeMismatchError(
            f"none of the {len(ck.tensors)} tensors in {ck.path} is a weight of the model of "
            f"{pkg.path}: the first is {first!r}, the model's are named like {known}; give a "
            f"checkpoint of the model the package was generated from")
    return best, names.conventions[best]


def _check_shape(ck: CheckpointFiles, key: str, name: str, want: tuple[int, ...]) -> None:
    got = ck.tensors[key].shape
    if tuple(got) != tuple(want):
        raise RuntimeMismatchError(
            f"{ck.path}: tensor {key!r} has shape {list(got)}, but the model's {name} has "
            f"{list(want)}: a checkpoint of another model or configuration; give the checkpoint "
            f"of the configuration the package was generated for")


def _example(names: ModelNames, convention: str) -> str:
    inverse = names.external(convention)
    for n in names.held:
        if n in inverse and n not in names.adapter:
            return inverse[n]
    return next(iter(names.conventions.get(convention, {})), "")


def _file_name(names: ModelNames, name: str) -> str:
    for convention in (TRANSFORMERS, PEFT):
        ext = names.external(convention).get(name)
        if ext is not None and ext != name:
            return f" ({ext!r} in a {convention} checkpoint)"
    return ""


def _more(items: Sequence[Any]) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""
