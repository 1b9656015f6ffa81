"""Runtime, masters beside images: how the host store keeps the master weights next to the
images the device loads, by the two dtypes (`store_mode`), and the split of float32 masters
into bfloat16 images and int16 residuals (`split_master`, `join_master`).
"""

from __future__ import annotations

import torch


def store_mode(master_dtype: torch.dtype, transfer_dtype: torch.dtype) -> str:
    """How a store keeps the masters beside the images the GPU loads: "direct" (the same
    dtype: the image is the master), "split" (float32 masters, bfloat16 images: the image is
    the master's high half, a residual its low half; see split_master), "separate" (any other
    pair, float16 images: a master of its own, cast into the image after each update)."""
    if master_dtype == transfer_dtype:
        return "direct"
    if master_dtype == torch.float32 and transfer_dtype == torch.bfloat16:
        return "split"
    return "separate"


def split_master(master: torch.Tensor, image: torch.Tensor, residual: torch.Tensor) -> None:
    """float32 `master` -> its bfloat16 `image` (int16 bits: round to nearest, ties away from
    zero) and the int16 `residual` that makes it whole again (`join_master`).

    A float32's bits are its bfloat16 truncation (high half) and 16 more bits (low half). The
    image is the high half plus one where the low half is 0x8000 or more: rounding to nearest,
    which differs from `.to(torch.bfloat16)` only at exact ties (ties to even there). The
    residual is the low half read as a signed int16, which is negative exactly where one was
    added: high = image - (residual < 0), and the float32 is exact again. The image is thus
    the half of the master the GPU loads, and no separate float32 copy is kept.
    """
    halves = master.view(torch.int16).view(-1, 2)  # little-endian: [low, high] per float32
    residual.copy_(halves[:, 0])
    image.copy_(halves[:, 1])
    image.add_(residual.lt(0).view(torch.int8))


def join_master(image: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> None:
    """The float32 masters of `image` (int16 bits of bfloat16) and `residual` into `out`."""
    halves = out.view(torch.int16).view(-1, 2)
    halves[:, 0].copy_(residual)
    torch.sub(image, residual.lt(0).view(torch.int8), out=halves[:, 1])

