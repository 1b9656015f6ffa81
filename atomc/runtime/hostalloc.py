"""Host memory the plan can count: freed blocks of 1 MiB and more go back to the system.

glibc's malloc serves a block above its mmap threshold (128 KiB at start) with a mapping of its
own and unmaps it when freed; but freeing one raises the threshold to that block's size (up to
32 MiB), so later blocks of that size come from its heaps and, once freed, stay there. A run
then holds transients that no longer exist: weights read from a checkpoint one by one,
gradients cast for the update, a disk tier's segments. On bench/nvme_bench.py's run that was
half again the plan's host figure. Fixing the threshold (mallopt(M_MMAP_THRESHOLD)) turns the
adjustment off; blocks below it are small enough not to matter.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD_BYTES = 1 << 20
ENV = "MALLOC_MMAP_THRESHOLD_"  # a user's own setting wins

_fixed: bool | None = None


def return_freed_blocks() -> bool:
    """Fix glibc's mmap threshold at THRESHOLD_BYTES, once per process (not where the user set
    it). False where the C library is not glibc, which keeps no such heap blocks."""
    global _fixed
    if _fixed is None:
        _fixed = False
        if sys.platform.startswith("linux") and ENV not in os.environ:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):
                return False
            mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
            _fixed = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))
    return _fixed
