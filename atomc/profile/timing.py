"""Timers for one device: CUDA events on GPUs, perf_counter on the CPU; median of repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 2,
            repeats: int = 5) -> float:
    """Median wall time of fn() in milliseconds."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


class CopyTimer:
    """Host-to-device copy time of a number of bytes: a real pinned copy on CUDA.

    On the CPU the "device" is host memory and a load is a memcpy into the working buffer,
    which is what the CPU runtime does too. Results are cached by size.
    """

    def __init__(self, device: torch.device, repeats: int = 5):
        self.device = device
        self.repeats = repeats
        self.cache: dict[int, float] = {}

    def load_ms(self, num_bytes: int) -> float:
        if num_bytes <= 0:
            return 0.0
        if num_bytes not in self.cache:
            pin = self.device.type == "cuda"
            src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
            src.fill_(1)
            dst = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
            self.cache[num_bytes] = time_ms(lambda: dst.copy_(src, non_blocking=pin), self.device,
                                            warmup=1, repeats=self.repeats)
            del src, dst
        return self.cache[num_bytes]

    def bandwidth_gbps(self, num_bytes: int = 64 * 2**20) -> float:
        return num_bytes / (self.load_ms(num_bytes) * 1e-3) / 1e9

    def d2h_gbps(self, num_bytes: int = 64 * 2**20) -> float:
        pin = self.device.type == "cuda"
        src = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
        ms = time_ms(lambda: dst.copy_(src, non_blocking=pin), self.device, warmup=1,
                     repeats=self.repeats)
        return num_bytes / (ms * 1e-3) / 1e9
