"""SWARM, the wire: one micro-batch's named values in a hivemind ExpertRequest/ExpertResponse.

A message carries a JSON header (the call's metadata, and the entries: which names are tensors,
with shapes and dtypes, and which are plain values such as sizes) and the tensors in entry
order, each packed by `atomc.swarm.codec` (8-bit blockwise on the links when asked; integer
tensors, the RNG state among them, always exact). Entries are the layout runner's
(atomc.distributed.pipeline.value_entries), so a value that crosses a pipeline boundary there
crosses a SWARM link too.

A message travels as a stream of parts (`split`, `join`): the p2p daemon refuses a single
message over 4 MiB, and a stage's activations easily exceed that. The header rides in the
first part; each tensor's bytes are cut by hivemind's `split_for_streaming`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from atomc.distributed.pipeline import (
    decode_value,
    entry_of,
    entry_row,
    in_memory_order,
    laid_out,
    value_entries,
)
from atomc.errors import PeerError
from atomc.swarm.codec import decode_tensor, encode_tensor

STREAM_PART_BYTES = 1 << 20  # tensor bytes per part: well under the daemon's 4 MiB message limit


def encode(values: dict[str, Any], meta: dict[str, Any], *, compress: bool = False,
           response: bool = False) -> Any:
    """`values` (name -> tensor or plain value) and `meta` (JSON-able) as one message."""
    entries = value_entries(values, tuple(sorted(values)))
    header = {"meta": meta, "entries": [entry_row(e) for e in entries]}
    # in memory order: the receiver lays each out as the sender had it (`layout`)
    tensors = [encode_tensor(in_memory_order(values[e.name].detach()), compress)
               for e in entries if e.kind == "tensor"]
    cls = runtime_pb2.ExpertResponse if response else runtime_pb2.ExpertRequest
    return cls(tensors=tensors, metadata=json.dumps(header).encode())


def decode(msg: Any, device: torch.device) -> tuple[dict[str, Any], dict[str, Any]]:
    """The values and metadata of a message `encode` wrote; tensors on `device`."""
    try:
        header = json.loads(msg.metadata.decode())
        entries = [entry_of(row) for row in header["entries"]]
    except (ValueError, KeyError, TypeError) as e:
        raise PeerError(f"a SWARM message has a malformed header ({e}); every server and trainer "
                        f"must run the same atomc version") from None
    expected = sum(e.kind == "tensor" for e in entries)
    if len(msg.tensors) != expected:
        raise PeerError(f"a SWARM message holds {len(msg.tensors)} tensors, its header names "
                        f"{expected}: it arrived cut short")
    tensors = iter(msg.tensors)
    values: dict[str, Any] = {}
    for e in entries:
        if e.kind == "tensor":
            t = decode_tensor(next(tensors)).to(device)
            if t.numel() != math.prod(e.shape):
                raise PeerError(f"{e.name} arrived with {t.numel()} elements, its header says "
                                f"shape {e.shape}")
            values[e.name] = laid_out(t.detach().reshape(-1), e.shape, e.strides
                                      ).requires_grad_(t.requires_grad)
        else:
            values[e.name] = decode_value(e.value, device)
    return values, header["meta"]


def split(msg: Any, part_bytes: int = STREAM_PART_BYTES) -> Iterator[Any]:
    """`msg` as parts of at most about `part_bytes` tensor bytes each (`join` undoes it)."""
    cls = type(msg)
    first = {"metadata": msg.metadata}
    if isinstance(msg, runtime_pb2.ExpertRequest):
        first["uid"] = msg.uid  # a request's attempt (atomc.swarm.records)
    pieces: list[Any] = []
    size = 0
    for tensor in msg.tensors:
        for piece in split_for_streaming(tensor, part_bytes):
            if pieces and size + len(piece.buffer) > part_bytes:
                yield cls(tensors=pieces, **first)
                pieces, size, first = [], 0, {}
            pieces.append(piece)
            size += len(piece.buffer)
    yield cls(tensors=pieces, **first)


def join(parts: Iterable[Any]) -> Any:
    """The message `split` cut into `parts`."""
    parts = list(parts)
    if not parts:
        raise StreamClosed("a SWARM message arrived empty (the sender closed its stream early)")
    pieces = [t for m in parts for t in m.tensors]
    tensors = []
    i = 0
    while i < len(pieces):
        n = max(1, pieces[i].chunks)  # the first piece of a tensor says how many follow
        if i + n > len(pieces):
            raise PeerError(f"a SWARM message arrived cut short: a tensor in {n} parts, "
                            f"{len(pieces) - i} received")
        tensors.append(combine_from_streaming(pieces[i:i + n]))
        i += n
    msg = type(parts[0])(tensors=tensors, metadata=parts[0].metadata)
    if isinstance(msg, runtime_pb2.ExpertRequest):
        msg.uid = parts[0].uid
    return msg


class StreamClosed(PeerError):
    """The peer's stream ended before a message: its process died (or closed) mid-call."""


class NotHere(PeerError):
    """Raised by a server for a call to a stage it does not serve (now): it is moving, or it
    serves another one. Not a fault: the trainer routes elsewhere without banning it."""

    elsewhere = True


class WrongAttempt(PeerError):
    """Raised by a server for a backward call that names another attempt than its own
    (`attempt`, atomc.swarm.records): the trainer learns the server's and calls again."""

    def __init__(self, said: str, attempt: int):
        super().__init__(said)
        self.attempt = attempt


class StepTaken(PeerError):
    """Raised by a server for a call of a step its stage has taken. A stage takes a step only
    once its servers hold the step's whole batch, each micro-batch once: a backward call of
    that step is one sent again (its answer was lost, or the trainer took the server for
    gone), and its micro-batch was counted. Not a fault: nothing is left to route."""

    taken = True


class Refused(PeerError):
    """A server refused a call (or failed it) and said so; `held`: it holds the call's
    micro-batch among its gradients all the same (from an earlier call); `elsewhere`: it does
    not serve the call's stage now (`NotHere`); `attempt`: the server's attempt, when the call
    named another (`WrongAttempt`); `taken`: its stage has taken the call's step (`StepTaken`)."""

    def __init__(self, said: str, held: bool, elsewhere: bool = False,
                 attempt: int | None = None, taken: bool = False):
        super().__init__(said)
        self.held, self.elsewhere, self.attempt = held, elsewhere, attempt
        self.taken = taken


def refusal(error: BaseException, held: bool) -> Any:
    """A response that carries a server's refusal or failure in its words (an exception in a
    streaming handler reaches the caller only as a closed stream)."""
    said = " ".join(f"{type(error).__name__}: {error}".split())[:500]
    return runtime_pb2.ExpertResponse(metadata=json.dumps({
        "error": said, "held": held, "elsewhere": bool(getattr(error, "elsewhere", False)),
        "attempt": getattr(error, "attempt", None),
        "taken": bool(getattr(error, "taken", False))}).encode())


def check_refusal(msg: Any) -> Any:
    """`msg`, unless it is a refusal (`refusal`): then Refused."""
    if not msg.tensors and msg.metadata.startswith(b'{"error"'):
        said = json.loads(msg.metadata.decode())
        attempt = said.get("attempt")
        raise Refused(str(said["error"]), bool(said.get("held")), bool(said.get("elsewhere")),
                      attempt if isinstance(attempt, int) else None, bool(said.get("taken")))
    return msg
