"""SWARM link compression: a tensor sent between pipeline stages (activation or gradient) in,
a hivemind `runtime_pb2.Tensor` message out, and back.

The codec is atomc.distributed.codecs's blockwise absmax int8 (`Blockwise8BitCompression`, one
float32 scale per block of `BLOCK_NUMEL` values, a value off by at most half its block's
scale), which DiLoCo's int8 rounds use too; see that module for its layout, its error and its
cost. `decode_tensor` decodes BLOCKWISE_8BIT itself (hivemind's stock 8-bit decoders need
bitsandbytes or fail under numpy 2) and leaves every other compression type to hivemind;
nothing in hivemind is patched.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from hivemind.proto import runtime_pb2

from atomc.distributed.codecs import (
    BLOCK_NUMEL,
    MIN_COMPRESSED_NUMEL,
    Blockwise8BitCompression,
    raw_message,
)

_CODEC = Blockwise8BitCompression()


def encode_tensor(tensor: torch.Tensor, compress: bool) -> runtime_pb2.Tensor:
    """Serialize a CPU tensor for the link: blockwise int8 if `compress` (exact passthrough for
    the tensors named in Blockwise8BitCompression), else exact bytes (NONE)."""
    return _CODEC.compress(tensor) if compress else raw_message(tensor)


def decode_tensor(msg: runtime_pb2.Tensor) -> torch.Tensor:
    """Rebuild the tensor: original shape, dtype and requires_grad flag."""
    return _CODEC.extract(msg).requires_grad_(msg.requires_grad)


def message_bytes(messages: Iterable[runtime_pb2.Tensor]) -> int:
    """Serialized size of the messages: what a micro-batch's tensors cost on the link, before the
    RPC's own framing (a few bytes per message and per streamed part)."""
    return sum(msg.ByteSize() for msg in messages)


# the codec's names, for SWARM's readers (atomc.distributed.codecs defines them)
__all__ = ["BLOCK_NUMEL", "MIN_COMPRESSED_NUMEL", "Blockwise8BitCompression", "decode_tensor",
           "encode_tensor", "message_bytes"]
