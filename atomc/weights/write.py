"""Weights out: a trainer's weights -> a directory that transformers, peft or safetensors load.

What `save_pretrained(trainer, DIR)` writes:

- a model built from a transformers config (examples/hf.py): the weights under the
  transformers model's own names (atomc.weights.names, convention "transformers") in
  safetensors shards with `model.safetensors.index.json` (one `model.safetensors` when they
  fit one shard), its `config.json` (and `generation_config.json` when it generates), so that
  `AutoModelForCausalLM.from_pretrained(DIR)` loads it;
- a peft model: its adapter in peft's own format (adapter_model.safetensors and
  adapter_config.json, written by peft's `save_pretrained`), which
  `PeftModel.from_pretrained(base, DIR)` loads; the base weights stay those of the checkpoint
  the training started from (when weights outside the adapter were trained too, every weight
  is also written in shards under the original names);
- any other model, and a model with weights outside its transformers model (a head of its
  own): the weights under the original model's state-dict names in the same shards, which
  `safetensors.torch.load_file` reads back into a state dict.

A tied weight is written once, under the name the package holds it by, as transformers' and
safetensors' own `save_model` write it (two names over one memory are refused by the
safetensors writer, and would be two copies on disk). Its other names are recorded: in each
shard's metadata (`atomc.tied`: other name -> written name, JSON) and in `atomc-export.json`.
`safetensors.torch.load_model`, transformers' `from_pretrained` and `atomc train --weights` tie
them again; a plain state dict is completed with `tied_names` (or `load_state_dict(...,
strict=False)` into a model that ties them itself). `atomc-export.json` records what was
exported.

Memory: the shards are written from the host masters directly (no copy of the model); the
safetensors writer holds one shard's bytes at a time, so the peak is the trainer's memory
plus one shard (`max_shard_size`, 2 GB by default). The directory is written beside the
target under a temporary name and renamed into place; an existing directory is replaced only
when atomc exported it (it holds atomc-export.json).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from atomc.dtypes import parse_dtype
from atomc.errors import RuntimeMismatchError, UsageError
from atomc.jsonio import write_dir_atomic
from atomc.weights.names import ORIGINAL, TRANSFORMERS, ModelNames, package_names
from atomc.weights.read import SAFETENSORS_INDEX, require

EXPORT_MARKER = "atomc-export.json"
DEFAULT_SHARD = "2GB"


def save_pretrained(trainer: Any, directory: str | Path, *,
                    max_shard_size: int | str = DEFAULT_SHARD,
                    dtype: str | torch.dtype | None = None) -> Path:
    """Write the trainer's current weights to `directory` (see the module docstring); returns
    the directory. `dtype` casts floating-point weights as they are written (default: the
    masters' dtype)."""
    out = Path(directory)
    _check_target(out)
    cast = parse_dtype(dtype, "dtype")
    names = package_names(trainer.package, trainer.host_modules)
    with trainer.weights_in_host_modules() as modules:  # waits for pending updates
        return _save(trainer, names, modules, out, max_shard_size, cast)


def _save(trainer: Any, names: ModelNames, modules: list[Any], out: Path,
          max_shard_size: int | str, cast: torch.dtype | None) -> Path:
    state = {**trainer.unread, **trainer.package.export_state_dict(modules)}
    state = {n: state[n] for n in _model_order(names, state)}
    # a tied weight once, under its held name
    tied = {n: names.canonical(n) for n in state
            if names.canonical(n) != n and names.canonical(n) in state}
    state = {n: t for n, t in state.items() if n not in tied}
    written_dtype = cast or trainer.store.master_dtype
    external = names.external(TRANSFORMERS)
    trained = {e.key for L in trainer.store.layouts for e in L.entries if e.trainable}
    with write_dir_atomic(out) as tmp:
        if names.peft_model is not None:
            kind = "peft adapter"
            _write_adapter(names, state, tmp, cast)
            if trained - names.adapter:  # trained weights outside the adapter: all of them too
                kind += f" and {ORIGINAL} names"
                _write_shards(state, tmp, max_shard_size, cast, tied)
        elif names.hf_model is not None and all(n in external for n in (*state, *tied)):
            kind = TRANSFORMERS
            tied = {external[a]: external[n] for a, n in tied.items()}
            _write_shards({external[n]: t for n, t in state.items()}, tmp, max_shard_size, cast,
                          tied)
            _write_hf_config(names, tmp, written_dtype)
        else:  # (a model with weights outside its transformers model: all of them, as named)
            kind = ORIGINAL
            _write_shards(state, tmp, max_shard_size, cast, tied)
        record = {"kind": "atomc.export", "names": kind, "package": str(trainer.package.path),
                  "plan_hash": trainer.package.plan_hash, "step": trainer.step_count,
                  "dtype": str(written_dtype).replace("torch.", ""), "tied": tied}
        (tmp / EXPORT_MARKER).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        if out.is_dir() and not any(out.iterdir()):  # an empty directory: renamed over, no backup
            out.rmdir()
    return out


def _model_order(names: ModelNames, state: dict[str, torch.Tensor]) -> list[str]:
    first = [n for n in names.model_names if n in state]
    placed = set(first)
    return first + [n for n in state if n not in placed]


def tied_names(directory: str | Path) -> dict[str, str]:
    """What an export wrote once for tied weights: each other name -> the name written."""
    marker = Path(directory) / EXPORT_MARKER
    try:
        return dict(json.loads(marker.read_text(encoding="utf-8")).get("tied") or {})
    except (OSError, ValueError, AttributeError) as e:
        raise RuntimeMismatchError(f"{marker} cannot be read ({e}); give a directory written "
                                   f"by atomc export") from None


def _write_shards(state: dict[str, torch.Tensor], out: Path, max_shard_size: int | str,
                  cast: torch.dtype | None, tied: dict[str, str]) -> None:
    """safetensors shards as huggingface_hub splits them, and their index when there are
    several; `tied` (other name -> written name) goes in each shard's metadata."""
    split = require("huggingface_hub").split_torch_state_dict_into_shards
    save_file = require("safetensors.torch").save_file

    def dtype_of(t: torch.Tensor) -> torch.dtype:
        return cast if cast is not None and t.is_floating_point() else t.dtype

    # the split sees stand-ins: the masters are views of one buffer, which it would take for
    # one tensor shared by all
    stand_ins = {k: torch.empty(t.shape, dtype=dtype_of(t), device="meta")
                 for k, t in state.items()}
    try:
        shards = split(stand_ins, max_shard_size=max_shard_size,
                       filename_pattern="model{suffix}.safetensors")
    except ValueError as e:
        raise UsageError(f"max shard size {max_shard_size!r}: {e}; give a size such as 2GB or "
                         f"500MB") from None
    metadata = {"format": "pt"}
    if tied:
        metadata["atomc.tied"] = json.dumps(tied, sort_keys=True)
    for filename, keys in shards.filename_to_tensors.items():
        shard = {k: state[k].detach().to(dtype_of(state[k])).contiguous() for k in keys}
        save_file(shard, str(out / filename), metadata=metadata)
    if shards.is_sharded:
        index = {"metadata": dict(shards.metadata), "weight_map": dict(shards.tensor_to_filename)}
        (out / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n",
                                             encoding="utf-8")


def _write_hf_config(names: ModelNames, out: Path, dtype: torch.dtype) -> None:
    """The transformers model's config.json (and generation_config.json), as its own
    save_pretrained writes them."""
    model = names.hf_model
    assert model is not None
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(str(out))


def _write_adapter(names: ModelNames, state: dict[str, torch.Tensor], out: Path,
                   cast: torch.dtype | None) -> None:
    """The peft adapter, written by peft itself from the trained values."""
    model = names.peft_model
    assert model is not None
    prefix = names.peft_prefix
    relative = {n[len(prefix):]: (t.to(cast) if cast is not None and t.is_floating_point()
                                  else t)
                for n, t in state.items() if n.startswith(prefix) and n in names.adapter}
    model.save_pretrained(str(out), state_dict=relative)


def _check_target(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise RuntimeMismatchError(f"{out} is a file; give a directory to export into")
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_MARKER).is_file():
        raise RuntimeMismatchError(f"{out} exists and is not a directory atomc exported (no "
                                   f"{EXPORT_MARKER}); give a new or empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
