"""SWARM, the wire: one micro-batch's named values in a hivemind ExpertRequest/ExpertResponse.

A message carries a JSON header (the call's metadata, and the entries: which names are tensors,
with shapes and dtypes, and which are plain values such as sizes) and the tensors in entry
order, each packed by `atomc.swarm.codec` (8-bit blockwise on the links when asked; integer
tensors, the RNG state among them, always exact). Entries are the layout runner's
(atomc.distributed.pipeline.describe), so a value that crosses a pipeline boundary there
crosses a SWARM link too.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from hivemind.proto import runtime_pb2

from atomc.distributed.pipeline import Entry, _decode, describe
from atomc.errors import PeerError
from atomc.swarm.codec import pack, unpack


def encode(values: dict[str, Any], meta: dict[str, Any], *, compress: bool = False,
           response: bool = False) -> Any:
    """`values` (name -> tensor or plain value) and `meta` (JSON-able) as one message."""
    entries = describe(values, tuple(sorted(values)))
    header = {"meta": meta,
              "entries": [[e.name, e.kind, list(e.shape), e.dtype, e.grad, e.value]
                          for e in entries]}
    tensors = [pack(values[e.name].detach(), compress) for e in entries if e.kind == "tensor"]
    cls = runtime_pb2.ExpertResponse if response else runtime_pb2.ExpertRequest
    return cls(tensors=tensors, metadata=json.dumps(header).encode())


def decode(msg: Any, device: torch.device) -> tuple[dict[str, Any], dict[str, Any]]:
    """The values and metadata of a message `encode` wrote; tensors on `device`."""
    try:
        header = json.loads(msg.metadata.decode())
        entries = [Entry(n, k, tuple(s), d, bool(g), v) for n, k, s, d, g, v in header["entries"]]
    except (ValueError, KeyError, TypeError) as e:
        raise PeerError(f"a SWARM message has a malformed header ({e}); every server and trainer "
                        f"must run the same atomc version") from None
    tensors = iter(msg.tensors)
    values: dict[str, Any] = {}
    for e in entries:
        if e.kind == "tensor":
            t = unpack(next(tensors)).to(device)
            if tuple(t.shape) != e.shape:
                raise PeerError(f"{e.name} arrived with shape {tuple(t.shape)}, its header says "
                                f"{e.shape}")
            values[e.name] = t
        else:
            values[e.name] = _decode(e.value, device)
    return values, header["meta"]


def wire_bytes(msg: Any) -> int:
    """Bytes the message takes on the wire (protobuf encoding)."""
    return int(msg.ByteSize())
