"""Runtime, the disk tier: model states in files on NVMe drives, read and written by direct I/O.

Input: the directories of `--offload-dir` (one per drive) and, per sub-model, the bytes of its
record (what the plan puts on disk of it: its image, the masters' residual or float32 copy,
AdamW's two moments, each region 4 KiB-aligned). Output: `StateFiles`, which reads a record
into a caller's buffer and writes one back, asynchronously, the drives striped.

- Direct I/O (O_DIRECT) into aligned buffers the caller reuses, a stripe (4 MiB) per request,
  several requests in flight per drive on a pool of threads (`os.preadv`/`os.pwritev` release
  the GIL). Stripe s of a record is on drive s % D, at (s // D) * STRIPE in that drive's file:
  every drive serves every record. A directory whose file system refuses O_DIRECT (tmpfs,
  some network file systems) is used through the page cache, and `direct` says so; the
  trainer says it in one line.
- Write aside, then switch: a record is written to files of a new generation
  (`sub0003.g12`), flushed (fsync), and only then becomes the record; the previous
  generation's files are unlinked. A write that a SIGKILL interrupts leaves the previous
  generation whole. `link` hard-links the current generation into a checkpoint's directory:
  later writes make new files, so the checkpoint's copy never changes, and costs no bytes
  until the run's record moves on.
- A read of a record waits for a pending write of it (the file it reads is the new one).

Each run works in `<dir>/atomc-run-<pid>-<n>/`, removed when the trainer closes; a start
removes the run folders of processes that are gone (a killed run's files).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from atomc.errors import UsageError
from atomc.partition.hostmem import DISK_ALIGN as ALIGN  # what O_DIRECT asks of addresses
from atomc.partition.hostmem import aligned
from atomc.units import format_bytes

STRIPE = 4 << 20  # bytes per request; a record's stripes go round the drives
REQUESTS_PER_DRIVE = 4  # requests in flight on each drive
RUN_PREFIX = "atomc-run-"


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` (rounded up to ALIGN) at a page-aligned address, as direct
    I/O needs: an anonymous mapping, kept alive by the tensor."""
    size = max(ALIGN, aligned(nbytes))
    block = mmap.mmap(-1, size)
    t = torch.frombuffer(block, dtype=torch.uint8)
    t._atomc_block = block  # type: ignore[attr-defined]  # the mapping lives with the tensor
    return t


@dataclass(frozen=True)
class DriveCheck:
    """What `check_dirs` found of one directory."""

    path: Path
    free_bytes: int
    direct: bool  # O_DIRECT works there
    device: int  # the file system's (st_dev): folders of one drive share its rate


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_runs(directory: Path) -> list[Path]:
    """Remove the run folders in `directory` whose process is gone (a killed run's files)."""
    removed = []
    for run in directory.glob(f"{RUN_PREFIX}*"):
        try:
            pid = int(run.name[len(RUN_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run)
    return removed


def check_dirs(dirs: Sequence[str | Path], need_bytes: int) -> list[DriveCheck]:
    """Each offload directory checked before anything is written: it exists and is a
    directory, it is writable, the drives have `need_bytes` free between them (statvfs; a
    killed run's leftovers are removed first), and whether O_DIRECT works there. One line for
    the first problem."""
    if not dirs:
        raise UsageError("no offload directory; give --offload-dir PATH (one per drive)")
    found: list[DriveCheck] = []
    for d in dirs:
        p = Path(d)
        if not p.exists():
            raise UsageError(f"offload directory {p} does not exist; create it (one per drive), "
                             f"or give another --offload-dir")
        if not p.is_dir():
            raise UsageError(f"offload directory {p} is a file; give a directory")
        remove_stale_runs(p)
        probe = p / f".atomc-probe-{os.getpid()}"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.close(fd)
        except OSError as e:
            raise UsageError(f"offload directory {p} is not writable ({e.strerror}); give a "
                             f"directory this user can write") from None
        direct = True
        try:
            fd = os.open(probe, os.O_RDWR | getattr(os, "O_DIRECT", 0))
            try:
                buf = aligned_buffer(ALIGN)
                os.pwritev(fd, [memoryview(buf.numpy())], 0)
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            direct = False
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
        st = os.statvfs(p)
        found.append(DriveCheck(p, st.f_bavail * st.f_frsize, direct and hasattr(os, "O_DIRECT"),
                                p.stat().st_dev))
    share = -(-need_bytes // len(found))  # the stripes spread evenly
    short = [c for c in found if c.free_bytes < share]
    if short:
        c = short[0]
        raise UsageError(f"offload directory {c.path} has {format_bytes(c.free_bytes)} free, "
                         f"the run needs {format_bytes(share)} there ({format_bytes(need_bytes)} "
                         f"over {len(found)} drive(s)); free space, or give more drives "
                         f"(--offload-dir, one per drive)")
    return found


class StateFiles:
    """The records of a run's sub-models in files on `dirs`, striped (see the module
    docstring). `sizes[i]`: the bytes of sub-model i's record (a multiple of ALIGN; 0: it has
    none on disk)."""

    def __init__(self, checks: Sequence[DriveCheck], sizes: Sequence[int]):
        self.drives = [c.path for c in checks]
        self.direct = all(c.direct for c in checks)
        self.sizes = list(sizes)
        assert all(n % ALIGN == 0 for n in self.sizes), "records are ALIGN-sized"
        self.runs = []
        for d in self.drives:
            for n in range(1000):
                run = d / f"{RUN_PREFIX}{os.getpid()}-{n}"
                try:
                    run.mkdir()
                except FileExistsError:
                    continue
                self.runs.append(run)
                break
        self.generation = [-1] * len(self.sizes)  # -1: never written
        self._pending: dict[int, Future] = {}  # the latest write of each record
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=REQUESTS_PER_DRIVE * len(self.drives),
                                        thread_name_prefix="atomc-disk")
        self._jobs = ThreadPoolExecutor(max_workers=4, thread_name_prefix="atomc-disk-record")
        self.bytes_read = 0
        self.bytes_written = 0

    def _paths(self, i: int, generation: int) -> list[Path]:
        return [run / f"sub{i:04d}.g{generation}" for run in self.runs]

    def _flags(self, write: bool) -> int:
        flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
        return flags | (os.O_DIRECT if self.direct else 0)

    def _pieces(self, offset: int, length: int) -> list[tuple[int, int, int, int]]:
        """(drive, file offset, range offset, bytes) of the stripes' parts that record bytes
        [offset, offset + length) fall in."""
        d = len(self.drives)
        out, at = [], offset
        while at < offset + length:
            s, within = divmod(at, STRIPE)
            n = min(STRIPE - within, offset + length - at)
            out.append((s % d, (s // d) * STRIPE + within, at - offset, n))
            at += n
        return out

    def _transfer(self, fds: list[int], offset: int, view: memoryview, write: bool,
                  what: str) -> None:
        def one(drive: int, at: int, pos: int, n: int) -> None:
            done = 0
            while done < n:
                chunk = [view[pos + done:pos + n]]
                got = (os.pwritev(fds[drive], chunk, at + done) if write
                       else os.preadv(fds[drive], chunk, at + done))
                if got <= 0:
                    raise OSError(errno.EIO, f"short {'write' if write else 'read'} of {what}")
                done += got

        futures = [self._pool.submit(one, *piece)
                   for piece in self._pieces(offset, len(view))]
        for f in futures:
            f.result()

    def begin_write(self, i: int) -> RecordWriter:
        """A new generation of record i, written range by range (in order), that becomes the
        record when `commit` has flushed it."""
        with self._lock:
            before = self._pending.get(i)
            writer = RecordWriter(self, i, before)
            self._pending[i] = writer.done
        return writer

    def write(self, i: int, buf: torch.Tensor, done: Callable[[], None] | None = None) -> Future:
        """Write record i from `buf` (an aligned buffer of at least its size) as a new
        generation; `done` runs once it is the record (its buffer may then be reused)."""
        writer = self.begin_write(i)
        writer.put(0, buf[:self.sizes[i]])
        return writer.commit(done)

    def read(self, i: int, buf: torch.Tensor, offset: int = 0,
             length: int | None = None, generation: int | None = None) -> Future:
        """Read bytes [offset, offset + length) of record i (the whole record by default;
        ALIGN multiples) into `buf`: after its pending write, or, given a `generation`, of
        that one as it is (a rewrite reading the generation it replaces)."""
        n = self.sizes[i] - offset if length is None else length
        with self._lock:
            before = self._pending.get(i) if generation is None else None

        def job() -> None:
            if before is not None:
                before.result()
            gen = self.generation[i] if generation is None else generation
            if gen < 0:
                raise RuntimeError(f"the state of sub-model {i} was never written to disk")
            fds = [os.open(p, self._flags(False)) for p in self._paths(i, gen)]
            try:
                self._transfer(fds, offset, memoryview(buf.numpy())[:n], False,
                               f"the state of sub-model {i}")
            finally:
                for fd in fds:
                    os.close(fd)
            self.bytes_read += n

        return self._jobs.submit(job)

    def settled(self, i: int) -> None:
        """Wait for record i's pending write."""
        with self._lock:
            before = self._pending.get(i)
        if before is not None:
            before.result()

    def flush(self) -> None:
        """Wait for every pending write."""
        with self._lock:
            pending = list(self._pending.values())
        for f in pending:
            f.result()

    def link(self, target: Path) -> list[list[str]]:
        """Hard-link every record's current files into `target/<drive>/` (one folder per
        drive, on the drive's own file system, beside the run's folder); returns the linked
        paths per record. The run's later writes make new files: the links keep this state."""
        self.flush()
        out = []
        for i in range(len(self.sizes)):
            if self.generation[i] < 0:
                out.append([])
                continue
            names = []
            for run, path in zip(self.runs, self._paths(i, self.generation[i])):
                folder = run.parent / target.name / run.name.removeprefix(RUN_PREFIX)
                folder.mkdir(parents=True, exist_ok=True)
                dest = folder / path.name
                with contextlib.suppress(FileNotFoundError):
                    dest.unlink()
                os.link(path, dest)
                names.append(str(dest))
            out.append(names)
        return out

    def adopt(self, i: int, paths: Sequence[str]) -> None:
        """Take the files of a checkpoint (`link`'s paths of record i) as record i: linked
        into the run's folder as a new generation."""
        self.flush()
        if len(paths) != len(self.runs):
            raise RuntimeError(f"the checkpoint holds sub-model {i}'s state on {len(paths)} "
                               f"drive(s), this run has {len(self.runs)}")
        new = self.generation[i] + 1
        for src, dest in zip(paths, self._paths(i, new)):
            os.link(src, dest)
        old, self.generation[i] = self.generation[i], new
        if old >= 0:
            for p in self._paths(i, old):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

    def close(self) -> None:
        """Finish pending writes and remove the run's files."""
        try:
            self.flush()
        finally:
            self._jobs.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            for run in self.runs:
                shutil.rmtree(run, ignore_errors=True)


class RecordWriter:
    """A new generation of one record being written (StateFiles.begin_write): ranges in the
    order `put` gets them, each after the one before, then `commit`."""

    def __init__(self, files: StateFiles, i: int, before: Future | None):
        self.files, self.i = files, i
        self.generation = files.generation[i] + 1
        self.done: Future = Future()  # set when the generation is the record
        self._last: Future | None = before
        self._fds: list[int] | None = None
        self._lock = threading.Lock()

    def _open(self) -> list[int]:
        if self._fds is None:
            f = self.files
            self._fds = [os.open(p, f._flags(True), 0o600)
                         for p in f._paths(self.i, self.generation)]
            size, d = f.sizes[self.i], len(f.drives)
            for drive, fd in enumerate(self._fds):  # each drive's share of the stripes
                stripes = len(range(drive, -(-size // STRIPE), d))
                if stripes:
                    os.posix_fallocate(fd, 0, stripes * STRIPE)
        return self._fds

    def put(self, offset: int, data: torch.Tensor, done: Callable[[], None] | None = None
            ) -> Future:
        """Write `data` (uint8, ALIGN multiples, ALIGN-aligned) at record byte `offset`,
        after the ranges put before; `done` runs when it is written (its buffer may then be
        reused)."""
        with self._lock:
            before = self._last

            def job() -> None:
                if before is not None:
                    before.result()
                fds = self._open()
                self.files._transfer(fds, offset, memoryview(data.numpy()), True,
                                     f"the state of sub-model {self.i}")
                if done is not None:
                    done()

            self._last = self.files._jobs.submit(job)
            return self._last

    def commit(self, done: Callable[[], None] | None = None) -> Future:
        """Flush the new generation and make it the record (the old one's files go); `done`
        runs after."""
        with self._lock:
            before = self._last

        def job() -> None:
            try:
                if before is not None:
                    before.result()
                fds = self._open()
                for fd in fds:
                    os.fsync(fd)
                    os.close(fd)
                f, i = self.files, self.i
                old = f.generation[i]
                f.generation[i] = self.generation
                if old >= 0:
                    for p in f._paths(i, old):
                        with contextlib.suppress(FileNotFoundError):
                            p.unlink()
                f.bytes_written += f.sizes[i]
                if done is not None:
                    done()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the record
                self.done.set_exception(e)
                return
            self.done.set_result(None)

        self.files._jobs.submit(job)
        return self.done
