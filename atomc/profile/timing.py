"""Timers for one device: CUDA events on GPUs, perf_counter on the CPU; median of repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 2,
            repeats: int = 5) -> float:
    """Median time of fn() in milliseconds: wall time on the CPU; on CUDA the longer of its
    GPU time and the host's time to issue it (see `device_host_ms`)."""
    return max(device_host_ms(fn, device, warmup, repeats))


def device_host_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 2,
                   repeats: int = 5) -> tuple[float, float]:
    """Medians of fn()'s device time and of the host's time to issue it, in milliseconds.

    On the CPU both are its wall time. On CUDA the calls are queued back to back behind a
    GPU sleep, as a training step queues them, so the device time is the kernels' alone: one
    call between two events also timed the GPU idling while the host launched it, for an
    operator of short kernels most of the figure (summed, such times overstated an H100's
    sub-models 1.5-2x, 10x for the smallest). Where issuing is the slower of the two, a step
    of such operators runs at the host's pace: callers take the longer.
    """
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        return _cuda_times(fn, device, repeats)
    samples: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(samples)
    return ms, ms


# A sample on CUDA queues calls until it holds about this much GPU time (at most MAX_CALLS).
SAMPLE_MS = 1.0
MAX_CALLS = 64
_CYCLES_PER_MS: dict[int, float] = {}


def _cycles_per_ms(device: torch.device) -> float:
    """GPU clock cycles per millisecond, for torch.cuda._sleep (once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES_PER_MS:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for _ in range(2):  # the first also loads the kernel
            start.record()
            torch.cuda._sleep(1_000_000)
            end.record()
            end.synchronize()
        _CYCLES_PER_MS[index] = 1_000_000 / max(start.elapsed_time(end), 1e-3)
    return _CYCLES_PER_MS[index]


def _cuda_times(fn: Callable[[], Any], device: torch.device,
                repeats: int) -> tuple[float, float]:
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    host_one = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    calls = max(1, min(MAX_CALLS, int(SAMPLE_MS / max(start.elapsed_time(end), 1e-3))))
    # the GPU sleeps while the host queues the sample's calls (twice their issue time, so the
    # queue is full before the first kernel runs); the start event fires when the sleep ends
    sleep_cycles = int(min(2 * calls * host_one + 0.2, 100.0) * _cycles_per_ms(device))
    gpu: list[float] = []
    host: list[float] = []
    for _ in range(repeats):
        torch.cuda._sleep(sleep_cycles)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) * 1e3 / calls)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / calls)
    return statistics.median(gpu), statistics.median(host)


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
