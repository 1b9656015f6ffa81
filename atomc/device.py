"""Parsing a user's device name into a torch.device that exists on this machine, and telling
what the device names that profiles and plans record stand for."""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING

from atomc.errors import AtomcError, UsageError

if TYPE_CHECKING:
    import torch


def parse_device(text: str | torch.device | None,
                 error: type[AtomcError] = UsageError) -> torch.device:
    """cpu, cuda or cuda:N; None means CUDA when present, else the CPU."""
    import torch  # here: planning reads device names and runs without torch

    if text is None:
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise error(f"device {text!r} is not a device; expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise error(f"device {text} asked for, but this machine has no CUDA device; "
                        f"use cpu, or (for profiles) --target NAME to estimate for a GPU")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise error(f"device {text} does not exist: {torch.cuda.device_count()} CUDA devices")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise error(f"device {text!r} is not supported; expected cpu, cuda or cuda:N")
    return device


def names_cpu(device: str) -> bool:
    """Whether a profile's or a plan's device name ("cpu (x86_64, 2 threads)", "cuda:0 (NVIDIA
    H100 ...)", a hardware profile's name: a GPU) is the CPU."""
    return device.startswith("cpu")


def describe_device(device: torch.device) -> str:
    """How profiles, plans and measurements name the device they ran on."""
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
