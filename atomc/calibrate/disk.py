"""The drives of the disk tier for the cost model: `--offload-dir` and `--disk-gbps`.

Input: the offload directories (`--offload-dir`, one per drive) of this machine, or the
drives of a machine that is not here (`--disks N --disk-gbps R[/W] --disk-capacity SIZE`).
Output: a DiskSpec (drives, each one's read and write rate, capacity, where the figures come
from) for atomc.partition.

A directory's rate is measured with the disk tier's own I/O (atomc.runtime.disk: direct I/O, a
stripe a request, several in flight): a record of BENCH_BYTES written, flushed and read back,
the median of BENCH_ROUNDS, cached per file system (its device and free space's order of
magnitude aside) in the host cache beside the CPU AdamW rate.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from atomc.errors import UsageError
from atomc.ir import DiskSpec
from atomc.jsonio import write_atomic
from atomc.units import parse_size

BENCH_BYTES = 1 << 30
BENCH_ROUNDS = 3
DRIVE_CACHE_FILE = "disk.json"
DRIVE_CACHE_VERSION = 1


def measure_drive(directory: str | Path, nbytes: int = BENCH_BYTES,
                  rounds: int = BENCH_ROUNDS) -> tuple[float, float, bool]:
    """(read GB/s, write GB/s, direct I/O) of the disk tier's own I/O in `directory`."""
    from atomc.runtime.disk import StateFiles, aligned, aligned_buffer, check_dirs

    size = aligned(nbytes)
    checks = check_dirs([directory], 2 * size)
    files = StateFiles(checks, [size])
    buf = aligned_buffer(size)
    buf.fill_(0x5A)  # not zeros: a file system may store zeros sparsely
    reads, writes = [], []
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            files.write(0, buf).result()
            writes.append(size / (time.perf_counter() - t0) / 1e9)
            _drop_cache(files)
            t0 = time.perf_counter()
            files.read(0, buf).result()
            reads.append(size / (time.perf_counter() - t0) / 1e9)
    finally:
        files.close()
    return statistics.median(reads), statistics.median(writes), files.direct


def _drop_cache(files: Any) -> None:
    """Without direct I/O the page cache would serve the read: ask the kernel to drop the
    record's pages (posix_fadvise), so the read goes to the drive."""
    if files.direct:
        return
    for path in files._paths(0, files.generation[0]):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cache_path() -> Path:
    from atomc.calibrate.host import CACHE_ENV

    base = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "atomc"
    return Path(base) / DRIVE_CACHE_FILE


def drive_rate(directory: str | Path) -> tuple[float, float, str]:
    """(read, write GB/s, where they come from) of the drive `directory` is on: measured once
    per file system and cached."""
    p = Path(directory)
    key = f"{os.stat(p).st_dev}:{p.resolve()}"
    path = _cache_path()
    try:
        data = json.loads(path.read_text())
        entries = data.get("drives", {}) if data.get("version") == DRIVE_CACHE_VERSION else {}
    except (OSError, ValueError, AttributeError):
        entries = {}
    entry = entries.get(key)
    if isinstance(entry, dict) and all(
            isinstance(entry.get(k), (int, float)) and math.isfinite(entry[k]) and entry[k] > 0
            for k in ("read_gbps", "write_gbps")):
        return entry["read_gbps"], entry["write_gbps"], f"measured in {p}, cached in {path}"
    read, write, direct = measure_drive(p)
    entries[key] = {"read_gbps": read, "write_gbps": write, "direct": direct,
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    how = "" if direct else " (through the page cache: the file system refuses direct I/O)"
    try:
        write_atomic(path, json.dumps({"version": DRIVE_CACHE_VERSION, "drives": entries},
                                      indent=1))
    except OSError as e:
        return read, write, f"measured in {p}{how}; not cached: cannot write {path} ({e})"
    return read, write, f"measured in {p}{how}, cached in {path}"


def parse_rate(value: str) -> tuple[float, float]:
    """`--disk-gbps R` or `R/W` (GB/s per drive, read and write) -> (read, write)."""
    parts = str(value).split("/")
    try:
        rates = [float(x) for x in parts]
    except ValueError:
        rates = []
    if len(rates) not in (1, 2) or not all(math.isfinite(r) and r > 0 for r in rates):
        raise UsageError(f"--disk-gbps {value!r} is not a positive rate; give GB/s per drive, "
                         f"read and write alike (7) or read/write (7.4/6.9)")
    return rates[0], rates[-1]


def resolve_disk(offload_dirs: list[str] | None, disks: int | None, disk_gbps: str | None,
                 disk_capacity: str | None) -> DiskSpec | None:
    """The drives the plan may put states on (None: none). Here: `offload_dirs`, their free
    space and their rate (measured, or `disk_gbps`). Elsewhere: `disks` drives of
    `disk_gbps` and `disk_capacity` each. One line for what does not fit together."""
    rate = parse_rate(disk_gbps) if disk_gbps is not None else None
    capacity = parse_size(disk_capacity, "--disk-capacity") if disk_capacity else 0
    if offload_dirs:
        if disks is not None:
            raise UsageError("give --offload-dir (the drives here) or --disks (a machine's "
                             "drives that are not here), not both")
        from atomc.runtime.disk import check_dirs

        checks = check_dirs(offload_dirs, 0)
        # folders on one file system share its drive: one drive's rate and space
        drives = list({c.device: c for c in checks}.values())
        checks = drives
        free = min(c.free_bytes for c in checks)
        if rate is not None:
            read, write, source = *rate, "given (--disk-gbps)"
        else:
            measured = [drive_rate(c.path) for c in checks]
            read = min(m[0] for m in measured)
            write = min(m[1] for m in measured)
            source = "; ".join(m[2] for m in measured)
        return DiskSpec(len(checks), read, write, capacity or free,
                        source + ("" if capacity else "; capacity: their free space now"))
    if disks is None:
        if rate is not None or capacity:
            raise UsageError("--disk-gbps and --disk-capacity describe drives: give them with "
                             "--disks N (a machine that is not here) or --offload-dir PATH")
        return None
    if disks < 1:
        raise UsageError(f"--disks {disks}: give 1 or more drives")
    if rate is None:
        raise UsageError(f"--disks {disks} needs each drive's rate: give --disk-gbps (e.g. "
                         f"7.4/6.9, GB/s read/write from the drive's data sheet)")
    return DiskSpec(disks, rate[0], rate[1], capacity,
                    "given (--disks, --disk-gbps" + (", --disk-capacity)" if capacity else ")"))
