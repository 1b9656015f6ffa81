"""Parsing and printing of memory sizes, bandwidths and times; ms <-> ns.

Sizes accept binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units, or a plain
number of bytes: `11GiB`, `512MiB`, `8GB`, `1.5GiB`, `4096`.
"""

from __future__ import annotations

import functools
import re

from atomc.errors import UsageError

# bytes per element of the dtypes the IR names (torch's names without "torch.")
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "int8": 1}
# the floating ones, which autocast and half-precision transfers change
FLOAT_BYTES = {d: DTYPE_BYTES[d] for d in ("float64", "float32", "float16", "bfloat16")}

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
ACCEPTED_SIZES = "a number with a unit, e.g. 11GiB, 512MiB, 8GB, 1.5GiB, or a plain byte count"


def parse_size(text: str | float, what: str = "size") -> int:
    """Bytes in `text`; raises UsageError naming the accepted forms."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise UsageError(f"{what} {text!r} is negative; expected {ACCEPTED_SIZES}")
        return int(text)
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise UsageError(f"{what} {text!r} is not a size; expected {ACCEPTED_SIZES}")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


@functools.lru_cache(maxsize=4096)  # the search states the same few sizes in every constraint
def format_bytes(num_bytes: float) -> str:
    """Short binary form: 1.50 GiB, 512.0 MiB, 12 B."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


NS_PER_MS = 1_000_000


def ms_to_ns(ms: float) -> int:
    """Whole nanoseconds in `ms` milliseconds: the simulator and the partition's cost model
    count time in integer ns, so that sums over thousands of actions do not drift."""
    return round(ms * NS_PER_MS)


def ns_to_ms(ns: float) -> float:
    return ns / NS_PER_MS


def format_ms(ms: float) -> str:
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms * 1000:.1f} us"


def format_count(n: float) -> str:
    """12.3M, 175.0B: for parameter and FLOP counts."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"
