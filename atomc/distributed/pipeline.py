"""Layout runner, pipeline: micro-batch schedules and the activation/gradient wires between stages.

input:  the number of micro-batches M, this stage j of D_PP, and the boundary values a stage
        hands its successor (names from the generated package)
output: the order of forward (F m) and backward (B m) tasks of one step (GPipe, or 1F1B as in
        PipeDream-flush), and `Link`s that move one micro-batch's boundary values (forward) or
        their gradients (backward) to a neighbour with asynchronous isend/irecv

A stage's three slots of DT-FM section 3.5 (receive, compute, send) overlap: receives are posted
ahead of use, sends are posted and only waited for at the end of the step; on CUDA they run on
their own streams. All values of one micro-batch travel as ONE byte buffer, whatever their dtypes
(each value at a 16-byte aligned offset in it).

Ordering (NCCL): NCCL ignores tags and runs every send and receive between two ranks of one
process group on one stream in issue order, a receive blocking that stream until its send
arrives. So each direction of each link has a process group of its own (`groups.build_groups`:
activations stage j -> j+1 on one, their gradients j+1 -> j on another): inside one direction
the sender's sends and the receiver's receives come in the same (micro-batch) order, and a
receive posted ahead in one direction never waits behind the other direction's traffic.

Boundary values that are not tensors (sizes, devices, flags a cut happens to cross) are handled
by shape agreement: the first message of a link is a header listing every value's name, shape,
dtype and whether it carries a gradient, and the value itself for non-tensors. Both sides then
hold fixed buffers; a later micro-batch whose values differ from the header stops the run with an
error instead of silently reading the wrong bytes.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Collection
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from atomc.dtypes import dtype_from_name, dtype_name
from atomc.errors import RuntimeMismatchError

TAG_HEADER = 11
TAG_ACT = 12
TAG_GRAD = 13

# ---------------------------------------------------------------------------------------------
# the header: shape agreement


@dataclass(frozen=True)
class Entry:
    name: str
    kind: str  # "tensor" or "value"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    grad: bool = False  # the receiver sends a gradient back for it
    value: Any = None  # a non-tensor, JSON-encoded (see encode_value)
    # a tensor's layout when it is not row-major (a transposed view), as strides: dropout draws
    # its mask in memory order, so a stage that received a row-major copy drew other masks
    # than the unpartitioned model
    strides: tuple[int, ...] = ()

    @property
    def num_bytes(self) -> int:
        if self.kind != "tensor":
            return 0
        return math.prod(self.shape) * _boundary_dtype(self.dtype).itemsize


def _boundary_dtype(name: str) -> torch.dtype:
    return dtype_from_name(name, "boundary dtype", RuntimeMismatchError)


def encode_value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.Size):
        return {"size": list(v)}
    if isinstance(v, torch.dtype):
        return {"dtype": dtype_name(v)}
    if isinstance(v, torch.device):
        return {"device": v.type}  # the receiver's own device of that type
    if isinstance(v, (list, tuple)):
        return {"tuple" if isinstance(v, tuple) else "list": [encode_value(x) for x in v]}
    raise RuntimeMismatchError(
        f"a boundary value of type {type(v).__name__} cannot cross a pipeline stage; cut the model "
        f"elsewhere (a stage boundary may carry tensors, numbers, sizes, dtypes and devices)")


def decode_value(v: Any, device: torch.device) -> Any:
    if not isinstance(v, dict):
        return v
    if "size" in v:
        return torch.Size(v["size"])
    if "dtype" in v:
        return _boundary_dtype(v["dtype"])
    if "device" in v:
        return device if device.type == v["device"] else torch.device(v["device"])
    if "tuple" in v:
        return tuple(decode_value(x, device) for x in v["tuple"])
    return [decode_value(x, device) for x in v["list"]]


def layout(t: torch.Tensor) -> tuple[int, ...]:
    """The strides of `t`'s dense layout (as torch.empty_like keeps it, and so as dropout's
    mask is laid out), or () when that is row-major."""
    dense = torch.empty_like(t, device="meta")
    return () if dense.is_contiguous() else tuple(dense.stride())


def in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as one row, in the order of its dense layout (`layout`)."""
    if t.is_contiguous():
        return t.reshape(-1)
    dense = torch.empty_like(t)
    dense.copy_(t)
    return dense.as_strided((dense.numel(),), (1,))


def laid_out(flat: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    """The tensor `in_memory_order` made a row of, back in its shape and layout."""
    return flat.view(shape) if not strides else flat.as_strided(shape, strides)


def value_entries(values: dict[str, Any], names: tuple[str, ...],
             grads: Collection[str] | None = None) -> tuple[Entry, ...]:
    """Entries of `values`; a floating tensor carries a gradient back when its name is in
    `grads` (the package's: atomc.runtime.package.SwapPackage.carries_grad), or, with no
    `grads`, always. requires_grad says nothing here: a swapped stage computes its forward
    without autograd and recomputes it."""
    out = []
    for n in names:
        v = values[n]
        if isinstance(v, torch.Tensor):
            out.append(Entry(n, "tensor", tuple(v.shape), dtype_name(v.dtype),
                             bool(v.is_floating_point() or v.is_complex())
                             and (grads is None or n in grads),
                             strides=layout(v)))
        else:
            out.append(Entry(n, "value", value=encode_value(v)))
    return tuple(out)


def entry_row(e: Entry) -> list[Any]:
    return [e.name, e.kind, list(e.shape), e.dtype, e.grad, e.value, list(e.strides)]


def entry_of(row: list[Any]) -> Entry:
    n, k, s, d, g, v, st = row
    return Entry(n, k, tuple(s), d, bool(g), v, tuple(st))


def header_bytes(entries: tuple[Entry, ...]) -> bytes:
    return json.dumps([entry_row(e) for e in entries]).encode()


def parse_header(raw: bytes) -> tuple[Entry, ...]:
    return tuple(entry_of(row) for row in json.loads(raw.decode()))


ALIGN = 16  # every value starts at a multiple of this in a packed buffer (any dtype's itemsize)


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def packed_bytes(entries: list[Entry] | tuple[Entry, ...]) -> int:
    """Bytes of the buffer `pack` fills for these (tensor) entries: each padded to ALIGN."""
    return sum(_padded(e.num_bytes) for e in entries)


def pack(tensors: list[torch.Tensor], total: int, device: torch.device) -> torch.Tensor:
    """Tensors of any dtypes into one byte buffer, each at an ALIGN-aligned offset (the padding
    bytes are left as they are); `total` is `packed_bytes` of their entries."""
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            buf[off:off + n].copy_(in_memory_order(t.detach()).view(torch.uint8))
        off += _padded(n)
    if off != total:
        raise RuntimeMismatchError(f"packed {off} bytes into a buffer of {total}; the boundary "
                                   f"values do not match their header")
    return buf


def unpack(buf: torch.Tensor, entries: list[Entry]) -> list[torch.Tensor]:
    """Views into `buf` (a packed buffer) with the entries' shapes and dtypes."""
    out, off = [], 0
    for e in entries:
        n = e.num_bytes
        t = laid_out(buf[off:off + n].view(_boundary_dtype(e.dtype)), e.shape, e.strides) \
            if n else torch.empty(e.shape, dtype=_boundary_dtype(e.dtype), device=buf.device)
        out.append(t)
        off += _padded(n)
    return out


# ---------------------------------------------------------------------------------------------
# transport: asynchronous point-to-point with an optional emulated delay


class _DelayLine:
    """Posts each send `delay_s` after it was handed over, in order, from its own thread: the
    link delay when the kernel cannot add it (no `tc netem`). Bandwidth is left to `tc`.

    One line per destination rank; a rank sends only one kind of traffic to a neighbour
    (activations to the next stage, gradients to the previous), so each process group is used
    by one thread of this process only. The future of a send gives its work object for
    `Transport.flush` to wait for (on CUDA: its stream waits), or None when it was waited for
    here already (gloo: in posting order, one send after another)."""

    def __init__(self, delay_s: float, name: str, wait_here: bool):
        self.delay_s = delay_s
        self.wait_here = wait_here
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, post) -> Future:
        fut: Future = Future()
        self.q.put((time.monotonic() + self.delay_s, post, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            due, post, fut = item
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                work = post()
                if self.wait_here:
                    work.wait()
                    work = None  # gloo's work cannot be waited for twice
                fut.set_result(work)
            except BaseException as e:  # noqa: BLE001 - surfaced when the step waits for its sends
                fut.set_exception(e)

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=5)


class Transport:
    """isend/irecv between this rank and its pipeline neighbours.

    `links` maps (source world rank, destination world rank) to the process group of that
    direction (see the module docstring); a pair without one uses `group` (default: the world).

    CUDA streams. Sends: the send stream waits for the caller's current stream (the producer of
    the buffer) when the send is handed over, and the buffer is marked as used on it; the send
    is posted under that stream, so NCCL's stream waits for the producer, also when a delay
    line posts it later from its own thread. Receives: the transport allocates the receive
    buffer itself, on the receive stream, and posts the receive under that stream; nothing else
    ever used that memory (the caching allocator keeps a block on the stream it was allocated
    on, and a block the caller's stream read is only reused there once those reads are done),
    so the receive does not wait for the caller's queued compute - the overlap the separate
    stream is for - and cannot overwrite memory a queued kernel still reads. `finish_recv`
    makes the caller's stream wait for the receive and marks the buffer as used there.
    """

    def __init__(self, device: torch.device, delay_ms: dict[int, float] | None = None,
                 group: Any = None, *, links: dict[tuple[int, int], Any] | None = None,
                 rank: int | None = None, dist: Any = None):
        if dist is None:
            import torch.distributed as dist

        self.dist = dist
        self.device = device
        self.group = group
        self.links = dict(links or {})
        self.rank = rank if rank is not None else (dist.get_rank() if self.links else -1)
        self.cuda = device.type == "cuda"
        self.send_stream = torch.cuda.Stream(device) if self.cuda else None
        self.recv_stream = torch.cuda.Stream(device) if self.cuda else None
        self.delay_ms = {k: v for k, v in (delay_ms or {}).items() if v > 0}
        self._lines: dict[int, _DelayLine] = {}
        self.pending: list[Any] = []  # (work or future, buffer kept alive)
        self.bytes_sent = 0

    def _ctx(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def group_to(self, dst: int) -> Any:
        return self.links.get((self.rank, dst), self.group)

    def group_from(self, src: int) -> Any:
        return self.links.get((src, self.rank), self.group)

    def delay_s(self, ranks: list[int] | tuple[int, ...]) -> float:
        """The largest emulated one-way delay (seconds) from this rank to any of `ranks`."""
        return max([self.delay_ms.get(r, 0.0) for r in ranks] + [0.0]) / 1e3

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> None:
        self.bytes_sent += buf.numel() * buf.element_size()
        if self.cuda:
            self.send_stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer
            buf.record_stream(self.send_stream)
        group = self.group_to(dst)

        def post() -> Any:
            with self._ctx(self.send_stream):
                return self.dist.isend(buf, dst, group=group, tag=tag)

        delay = self.delay_ms.get(dst, 0.0)
        if delay > 0:
            line = self._lines.get(dst)
            if line is None:
                line = self._lines[dst] = _DelayLine(delay / 1e3, f"atomc-link-{dst}",
                                                     wait_here=not self.cuda)
            self.pending.append((line.submit(post), buf))
        else:
            self.pending.append((post(), buf))

    def irecv(self, numel: int, dtype: torch.dtype, src: int, tag: int) -> tuple[Any, torch.Tensor]:
        """Post a receive into a new buffer of `numel` elements; returns (work, buffer)."""
        group = self.group_from(src)
        with self._ctx(self.recv_stream):
            buf = torch.empty(numel, dtype=dtype, device=self.device)  # on the receive stream
            return self.dist.irecv(buf, src, group=group, tag=tag), buf

    def finish_recv(self, work: Any, buf: torch.Tensor) -> None:
        work.wait()
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self.recv_stream)
            buf.record_stream(cur)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every send posted so far (their buffers may then be reused)."""
        for work, _ in self.pending:
            if isinstance(work, Future):
                work = work.result(timeout=timeout_s)
            if work is not None:
                work.wait()
        self.pending.clear()

    def close(self) -> None:
        for line in self._lines.values():
            line.close()
        self._lines.clear()


class Link:
    """One direction of boundary values between two neighbouring stages, and their gradients.

    The sending side (stage j) calls `send` per micro-batch and `recv_grads` in the backward;
    the receiving side (stage j+1) calls `recv` and `send_grads`. Receives are posted up to
    `window` micro-batches ahead of use.
    """

    def __init__(self, transport: Transport, peer: int, names: tuple[str, ...], *, window: int = 2,
                 where: str = "", grads: Collection[str] | None = None):
        self.t = transport
        self.peer = peer
        self.names = names
        self.grads = grads  # the names that carry a gradient back (None: every floating one)
        self.window = max(1, window)
        self.where = where
        self.entries: tuple[Entry, ...] | None = None
        self._recv_q: list[tuple[Any, torch.Tensor]] = []
        self._grad_q: list[tuple[Any, torch.Tensor]] = []
        self._acts_expected = 0  # receives still to post this step
        self._grads_expected = 0

    # ---- sizes ---------------------------------------------------------------------------------

    @property
    def tensor_entries(self) -> list[Entry]:
        assert self.entries is not None
        return [e for e in self.entries if e.kind == "tensor"]

    @property
    def grad_entries(self) -> list[Entry]:
        return [e for e in self.tensor_entries if e.grad]

    @property
    def act_bytes(self) -> int:
        return packed_bytes(self.tensor_entries)

    @property
    def grad_bytes(self) -> int:
        return packed_bytes(self.grad_entries)

    # ---- sender side ---------------------------------------------------------------------------

    def send(self, values: dict[str, Any]) -> None:
        entries = value_entries(values, self.names, self.grads)
        if self.entries is None:
            self.entries = entries
            raw = header_bytes(entries)
            head = torch.tensor(list(raw), dtype=torch.uint8, device=self.t.device)
            size = torch.tensor([len(raw)], dtype=torch.int64, device=self.t.device)
            self.t.isend(size, self.peer, TAG_HEADER)
            self.t.isend(head, self.peer, TAG_HEADER)
        elif entries != self.entries:
            changed = [f"{a.name}: {a.shape or a.value} -> {b.shape or b.value}"
                       for a, b in zip(self.entries, entries) if a != b]
            raise RuntimeMismatchError(
                f"{self.where}: boundary values changed between micro-batches "
                f"({'; '.join(changed)}); a pipeline needs the same shapes every micro-batch: use "
                f"a fixed sequence length and equal micro-batches")
        tensors = [values[e.name] for e in self.tensor_entries]
        if tensors:
            self.t.isend(pack(tensors, self.act_bytes, self.t.device), self.peer, TAG_ACT)

    def expect_grads(self, n: int) -> None:
        self._grads_expected = n
        self._post_grads()

    def _post_grads(self) -> None:
        if self.entries is None:
            return  # posted once the first send fixed the sizes
        if not self.grad_entries:
            self._grads_expected = 0
            return
        while self._grads_expected > 0 and len(self._grad_q) < self.window:
            self._grad_q.append(self.t.irecv(self.grad_bytes, torch.uint8, self.peer, TAG_GRAD))
            self._grads_expected -= 1

    def recv_grads(self) -> dict[str, torch.Tensor]:
        """Gradients of one micro-batch's values, in send order of the micro-batches."""
        if self.entries is None or not self.grad_entries:
            return {}
        self._post_grads()
        work, buf = self._grad_q.pop(0)
        self.t.finish_recv(work, buf)
        self._post_grads()
        return dict(zip((e.name for e in self.grad_entries), unpack(buf, self.grad_entries)))

    # ---- receiver side -------------------------------------------------------------------------

    def expect(self, n: int) -> None:
        self._acts_expected = n
        if self.entries is not None:
            self._post_recvs()

    def _post_recvs(self) -> None:
        if not self.act_bytes:
            self._acts_expected = 0
            return
        while self._acts_expected > 0 and len(self._recv_q) < self.window:
            self._recv_q.append(self.t.irecv(self.act_bytes, torch.uint8, self.peer, TAG_ACT))
            self._acts_expected -= 1

    def _recv_header(self) -> None:
        w, size = self.t.irecv(1, torch.int64, self.peer, TAG_HEADER)
        self.t.finish_recv(w, size)
        w, head = self.t.irecv(int(size.item()), torch.uint8, self.peer, TAG_HEADER)
        self.t.finish_recv(w, head)
        entries = parse_header(bytes(head.cpu().tolist()))
        names = tuple(e.name for e in entries)
        if names != self.names:
            raise RuntimeMismatchError(
                f"{self.where}: the previous stage sends {list(names)} but this stage expects "
                f"{list(self.names)}; the ranks run different generated packages: give every rank "
                f"the same package and layout")
        self.entries = entries

    def recv(self) -> dict[str, Any]:
        """One micro-batch's values: tensors (gradient-carrying ones as fresh leaves) and others."""
        if self.entries is None:
            self._recv_header()
        self._post_recvs()
        tensors: list[torch.Tensor] = []
        if self.act_bytes:
            work, buf = self._recv_q.pop(0)
            self.t.finish_recv(work, buf)
            self._post_recvs()
            tensors = unpack(buf, self.tensor_entries)
        out: dict[str, Any] = {}
        it = iter(tensors)
        for e in self.entries:
            if e.kind == "tensor":
                t = next(it)
                out[e.name] = t.requires_grad_(True) if e.grad else t
            else:
                out[e.name] = decode_value(e.value, self.t.device)
        return out

    def send_grads(self, grads: dict[str, torch.Tensor | None], values: dict[str, Any]) -> None:
        ents = self.grad_entries
        if not ents:
            return
        tensors = []
        for e in ents:
            g = grads.get(e.name)
            tensors.append(g if g is not None else torch.zeros_like(values[e.name]))
        self.t.isend(pack(tensors, self.grad_bytes, self.t.device), self.peer, TAG_GRAD)
