"""Dtype names: the one place that turns a dtype's name into a torch.dtype and back.

- `parse_dtype(value, what)`: a floating-point dtype a user chose (an option, a config, a
  checkpoint's field): float32/fp32, float64/fp64, bfloat16/bf16, float16/fp16/half, or a
  torch.dtype as is; UsageError naming `what` and the accepted names otherwise.
- `dtype_name(dtype)`: "float32" for torch.float32, the name the IR, checkpoints and the
  pipeline's wire headers write.
- `dtype_from_name(name, what, error)`: the inverse of dtype_name for every torch dtype (a
  name read back from a file or a wire header, not typed by a user).
- `cast_floating(module, dtype)`: a module's floating-point tensors in `dtype`, complex ones
  kept (`module.to(dtype)` would drop their imaginary part).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from atomc.errors import AtomcError, IRError, UsageError

if TYPE_CHECKING:
    import torch

# what users may write for each floating-point dtype, canonical name first (names, not
# torch.dtypes: planning reads them without importing torch)
_ALIASES = {
    "float32": ("float32", "fp32"),
    "float64": ("float64", "fp64"),
    "bfloat16": ("bfloat16", "bf16"),
    "float16": ("float16", "fp16", "half"),
}
_BY_ALIAS = {alias: name for name, aliases in _ALIASES.items() for alias in aliases}
ACCEPTED = ", ".join(
    names[0] + (f" ({', '.join(names[1:])})" if names[1:] else "") for names in _ALIASES.values()
)


def parse_dtype_name(value: str, what: str) -> str:
    """The canonical name of the floating-point dtype a user wrote ("bf16" -> "bfloat16")."""
    name = _BY_ALIAS.get(value) if isinstance(value, str) else None
    if name is None:
        raise UsageError(f"{what} {value!r} is not a training dtype; choose one of {ACCEPTED}")
    return name


def parse_dtype(value: str | torch.dtype | None, what: str) -> torch.dtype | None:
    """`value` as a torch.dtype; None stays None (the caller's default applies)."""
    import torch

    if value is None or isinstance(value, torch.dtype):
        return value
    return getattr(torch, parse_dtype_name(value, what))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, what: str = "dtype",
                    error: type[AtomcError] = IRError) -> torch.dtype:
    """The torch dtype `dtype_name` wrote as `name`; `error` when torch has no such dtype."""
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise error(f"{what} {name!r} is not a torch dtype")
    return dtype


def cast_floating(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module` with its floating-point parameters and buffers in `dtype`, in place.

    Not `module.to(dtype)`: that casts complex tensors too, and to a real dtype it drops their
    imaginary part (a rotary embedding's complex frequencies, registered as a buffer, become
    their cosines).
    """
    return module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
