"""Runtime, host copies: what the activation stash (atomc.runtime.stash) and the operator cache
(atomc.runtime.opcache) share to move values between the device and host memory beside the
executor's own traffic: its device, tracer and streams, host buffers by key reused every
step, and the events after which each sub-model's copies back to the device are done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from atomc.runtime.pinned import HostBuffers
from atomc.runtime.trace import Tracer


@dataclass(frozen=True)
class CopyLanes:
    """The executor's device, tracer and CUDA streams (None on the CPU, where every copy is
    done when it returns)."""

    device: torch.device
    tracer: Tracer
    compute: Any
    prefetch: Any
    offload: Any


class HostCopies:
    """The state both keep: the lanes, the host buffers, and per (sub-model, micro-batch) the
    event after its copies back to the device."""

    def __init__(self, lanes: CopyLanes):
        self.device = lanes.device
        self.cuda = lanes.device.type == "cuda"
        self.tracer = lanes.tracer
        self.compute_stream = lanes.compute
        self.prefetch_stream = lanes.prefetch
        self.offload_stream = lanes.offload
        # key -> its host buffer, reused every step: views into one arena (pinned on CUDA) once
        # a step has shown every key's shape (HostBuffers)
        self.buffers = HostBuffers(pin=self.cuda)
        self._back_ready: dict[tuple[int, int], Any] = {}  # (sub-model, micro-batch) -> event


__all__ = ["CopyLanes", "HostCopies"]
