"""Training data, the model's side: what a generated package takes, and the token ids it can
look up.

`token_input(package)`: the one input `atomc train` feeds, an integer tensor [batch, sequence]
(a language model's token ids); other models train through atomc.runtime.SwapTrainer.

`model_vocabulary(package, loss_fn)`: how many token ids the model can look up, found by
running the sub-models and the loss once on the meta device (no memory, no compute) and
watching which lookup tables the ids index: an embedding's rows, a cross-entropy's classes.
An id at or above that count is refused before it reaches the model: on a GPU it would be a
device-side assertion that ends the process, not an error message.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from atomc.errors import UsageError

_aten = torch.ops.aten


def token_input(package: Any) -> tuple[str, list[int], torch.dtype]:
    """(name, [micro-batch, sequence], dtype) of the package's one integer input; UsageError
    for a package that takes anything else."""
    names = package.model_inputs
    spec = package.input_specs().get(names[0], {}) if len(names) == 1 else {}
    shape = spec.get("shape")
    dtype_name = str(spec.get("dtype", "")).removeprefix("torch.")
    dtype = getattr(torch, dtype_name, None)
    if (len(names) != 1 or not shape or len(shape) != 2 or not isinstance(dtype, torch.dtype)
            or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
        raise UsageError(f"data of token ids (byte-level text, a token file, tokenized "
                         f"text) feeds a model with one integer input of shape "
                         f"[batch, sequence]; {package.path} takes {', '.join(names)} "
                         f"({spec or 'unknown shapes'}): train it with "
                         f"atomc.runtime.SwapTrainer")
    return names[0], [int(s) for s in shape], dtype


class _Lookups(TorchDispatchMode):
    """Follows the ids (and integer tensors computed from them) through aten calls and records
    the size of every table they index."""

    def __init__(self, ids: torch.Tensor):
        super().__init__()
        self.derived = {id(ids)}
        self.keep = [ids]  # alive, so that an id() is never reused
        self.sizes: list[int] = []

    def _is_ids(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.derived

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is _aten.embedding and len(args) >= 2 and self._is_ids(args[1]):
            self.sizes.append(int(args[0].shape[0]))
        elif packet is _aten.embedding_bag and len(args) >= 2 and self._is_ids(args[1]):
            self.sizes.append(int(args[0].shape[0]))
        elif (packet is _aten.index_select and len(args) >= 3 and self._is_ids(args[2])
              and args[1] in (0, -args[0].dim())):
            self.sizes.append(int(args[0].shape[0]))
        elif (packet is _aten.index and len(args) >= 2 and args[1]
              and self._is_ids(args[1][0])):
            self.sizes.append(int(args[0].shape[0]))
        elif (packet in (_aten.nll_loss_forward, _aten.nll_loss2d_forward) and len(args) >= 2
              and self._is_ids(args[1])):
            self.sizes.append(int(args[0].shape[1 if args[0].dim() > 1 else 0]))
        out = func(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        if any(self._is_ids(t) for t in flat_in):
            for t in tree_flatten(out)[0]:
                if (isinstance(t, torch.Tensor) and not t.is_floating_point()
                        and not t.is_complex() and t.dtype != torch.bool):
                    self.derived.add(id(t))
                    self.keep.append(t)
        return out


def model_vocabulary(package: Any, loss_fn: Callable[[Any, tuple], Any] | None = None
                     ) -> int | None:
    """The smallest table the token ids index on their way through the sub-models and
    `loss_fn`: ids below it are valid. None when no lookup was seen (the model's code did not
    run on the meta device before its first lookup)."""
    name, shape, dtype = token_input(package)
    try:
        modules = package.build_submodels(device="meta")
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: vocabulary unknown
        return None
    ids = torch.zeros(shape, dtype=dtype, device="meta")
    mode = _Lookups(ids)
    envs: dict[str, Any] = {name: ids}
    try:
        with mode, torch.no_grad():
            for i, module in enumerate(modules):
                out = module(*[envs[n] for n in package.inputs[i]])
                if i == len(modules) - 1:
                    if loss_fn is not None:
                        loss_fn(out, (ids,))
                    break
                values = out if isinstance(out, tuple) else (out,)
                envs.update(itertools.zip_longest(package.outputs[i], values))
    except Exception:  # noqa: BLE001 - meta lacks some kernel: keep the lookups seen before it
        pass
    return min(mode.sizes) if mode.sizes else None


__all__ = ["model_vocabulary", "token_input"]
