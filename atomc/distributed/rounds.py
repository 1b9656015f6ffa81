"""What an averaging round of peers puts on the wire: the dtype a round travels in, the hivemind
compression that carries it, how hivemind cuts the averaged tensors into parts, the bytes each
member sends and receives, and how far int8 moves a value.

input:  a round dtype (`ROUND_DTYPES`, or None: the master dtype, exact), the averaged tensors'
        sizes, the group's size and a member's place in hivemind's group order
output: the averager's `compression` (`compression_for`), the parts of each place
        (`split_parts`, hivemind's TensorPartContainer rule), the bytes of a round
        (`round_bytes`), the bound int8 keeps every value within (`int8_bound`)

Round dtypes, for the pseudo-gradients of DiLoCo's outer step (atomc.distributed.diloco):
- the master dtype (default): hivemind's NoCompression, exact;
- `float32`: the averaged tensor is float32 (float64 runs send half the bytes), uncompressed;
- `float16`: hivemind's own Float16Compression (clamped to float16's range);
- `bfloat16`: two bytes a value, bfloat16's range (Float16Compression has float16's);
- `int8`: blockwise absmax int8 with one float32 scale per block of
  atomc.distributed.codecs.BLOCK_NUMEL values (the codec SWARM's links use too): a value is off
  by at most half its block's scale, absmax / 254.

hivemind's butterfly all-reduce sends each member's copy of a part to the part's reducer, and
the reducer sends every sender the average minus that sender's copy, both in the part's
compression; a message names its codec by a tag of hivemind's fixed set. Its stock decoders for
blockwise int8 need bitsandbytes (and its 8-bit ones fail under numpy 2), and none is bfloat16,
so `register_codecs` puts atomc's int8 codec under BLOCKWISE_8BIT and its bfloat16 one under
MEANSTD_16BIT in hivemind's table of decoders (atomc.distributed.codecs). It runs in the
averager's own process (its `run`), where hivemind compresses and decodes a round's parts; the
peer's own process and any other hivemind user in it are left alone.

This module imports hivemind only inside `compression_for` and `register_codecs`, so that
`atomc compare` can size a round without it; the int8 layout's numbers below mirror the codec's
(tests/distributed/test_diloco.py checks them against its messages).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from atomc.errors import UsageError

ROUND_DTYPES = ("float32", "bfloat16", "float16", "int8")
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
PART_BYTES = 1 << 19  # hivemind's DecentralizedAverager part_size_bytes, which atomc keeps
# the int8 codec's layout (atomc.distributed.codecs): an int32 block size, a float32 scale per
# block, an int8 code per value; tensors under its minimum go uncompressed
INT8_BLOCK = 1024
INT8_MIN_NUMEL = 1024
INT8_HEADER_BYTES = 4


def check_round_dtype(value: str | None) -> str | None:
    if value is None or value in ROUND_DTYPES:
        return value
    raise UsageError(f"--round-dtype {value!r} is not one of {', '.join(ROUND_DTYPES)}; give "
                     f"float16 or bfloat16 (half the bytes) or int8 (a quarter), or leave it out "
                     f"(the master dtype, exact)")


def tensor_dtype(round_dtype: str | None, master_dtype: str) -> str:
    """The dtype of the averaged tensor: float32 rounds average a float32 tensor, every other
    dtype compresses a tensor in the master dtype on the wire."""
    return "float32" if round_dtype == "float32" else master_dtype


def wire_bytes(numel: int, round_dtype: str | None, value_bytes: int) -> int:
    """Bytes of one part of `numel` values on the wire (the payload; protobuf's framing, a few
    bytes a part, is left out). `value_bytes`: the averaged tensor's bytes per value."""
    if round_dtype in ("float16", "bfloat16"):
        return 2 * numel
    if round_dtype == "int8":
        if numel < INT8_MIN_NUMEL:
            return numel * value_bytes
        return INT8_HEADER_BYTES + 4 * -(-numel // INT8_BLOCK) + numel
    return numel * value_bytes


def compression_ratio(numel: int, round_dtype: str | None, value_bytes: int) -> float:
    """hivemind's estimate_compression_ratio for a whole tensor of `numel` values: wire bytes
    over raw bytes (what TensorPartContainer sizes its parts by)."""
    if numel <= 0:
        return 1.0
    return wire_bytes(numel, round_dtype, value_bytes) / (numel * value_bytes)


def values_per_part(numel: int, round_dtype: str | None, value_bytes: int,
                    part_bytes: int = PART_BYTES) -> int:
    """Values in each part of a tensor, as TensorPartContainer computes it: part_size_bytes
    over the compressed bytes of a value."""
    return int(part_bytes / (value_bytes * compression_ratio(numel, round_dtype, value_bytes)))


def split_parts(tensors: Sequence[tuple[int, int]], group_size: int
                ) -> list[list[tuple[int, int]]]:
    """(tensor index, values) of every part each place of the group order reduces, as
    hivemind's TensorPartContainer cuts `tensors` ((numel, values per part) each) for members
    that state no bandwidth (load_balance_peers gives them even shares): the tensors one after
    another, each in parts of its own size, every part given whole to the place whose even
    share (hagenbach_bishoff's) it overlaps most."""
    total = sum(n for n, _ in tensors)
    places: list[list[tuple[int, int]]] = [[] for _ in range(group_size)]
    if total <= 0:
        return places
    counts = [total // group_size] * group_size
    for i in range(total - sum(counts)):  # the remainder, one each from the first place
        counts[i] += 1
    pivots = [0] * group_size
    acc = 0
    for i, c in enumerate(counts):
        acc += c
        pivots[i] = int(acc / total * total)
    pivots[-1] = total
    place, begin = 0, 0
    for t, (numel, per_part) in enumerate(tensors):
        per_part = max(per_part, 1)
        for offset in range(0, numel, per_part):
            length = min(per_part, numel - offset)
            if begin + length > pivots[place]:
                first = place
                overlaps = [pivots[place] - begin]
                while begin + length > pivots[place]:
                    place += 1
                    overlaps.append(min(begin + length, pivots[place]) - pivots[place - 1])
                chosen = first + max(range(len(overlaps)), key=lambda k: (overlaps[k], -k))
                places[chosen].append((t, length))
            else:
                places[place].append((t, length))
            begin += length
    return places


def round_bytes(tensors: Sequence[tuple[int, str | None, int]], group_size: int, place: int
                ) -> tuple[int, int]:
    """(sent, received) bytes of the member at `place` of hivemind's group order in one round
    that averages `tensors` ((numel, round dtype, value bytes) each): its copy of every other
    place's parts goes out and the averages of its own parts go back to every other member;
    the others' copies of its parts come in, and the averages of theirs."""
    if group_size < 2:
        return 0, 0
    sizes = [(n, values_per_part(n, rd, vb)) for n, rd, vb in tensors]
    places = split_parts(sizes, group_size)

    def share(p: int) -> int:
        return sum(wire_bytes(length, tensors[t][1], tensors[t][2]) for t, length in places[p])

    others = sum(share(p) for p in range(group_size) if p != place)
    mine = share(place)
    return others + (group_size - 1) * mine, (group_size - 1) * mine + others


def int8_bound(x: Any, block: int = INT8_BLOCK) -> Any:
    """Per value of the flat tensor `x`, the largest error int8 can give it: half the step of
    its block (absmax / 127 / 2), blocks counted from the start of `x` (a part)."""
    import torch

    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    blocks = torch.zeros(-(-n // block) * block, dtype=torch.float32)
    blocks[:n] = flat.abs()
    half_step = blocks.view(-1, block).amax(dim=1) / 127 / 2
    return half_step.repeat_interleave(block)[:n]


# ---- hivemind codecs ----------------------------------------------------------------------------


def compression_for(round_dtype: str | None) -> Any:
    """The hivemind compression a round's pseudo-gradients are sent with (see the module
    docstring); `register_codecs` must have run in the averager's process for int8 and
    bfloat16."""
    from hivemind.compression import Float16Compression, NoCompression

    from atomc.distributed.codecs import BFloat16Compression, Blockwise8BitCompression

    if round_dtype == "float16":
        return Float16Compression()
    if round_dtype == "bfloat16":
        return BFloat16Compression()
    if round_dtype == "int8":
        return Blockwise8BitCompression()
    return NoCompression()


def register_codecs() -> None:
    """Put atomc's int8 and bfloat16 codecs in hivemind's table of decoders (the averager's
    process only: see the module docstring). Idempotent."""
    from hivemind.compression import serialization

    from atomc.distributed.codecs import BFloat16Compression, Blockwise8BitCompression

    table = serialization._BASE_COMPRESSION_TYPES
    table["BLOCKWISE_8BIT"] = Blockwise8BitCompression()
    table["MEANSTD_16BIT"] = BFloat16Compression()


__all__ = ["DTYPE_BYTES", "PART_BYTES", "ROUND_DTYPES", "check_round_dtype", "compression_for",
           "compression_ratio", "int8_bound", "register_codecs", "round_bytes", "split_parts",
           "tensor_dtype", "values_per_part", "wire_bytes"]
