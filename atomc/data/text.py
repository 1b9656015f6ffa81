"""Data, byte-level text batches by step (the demo, benchmarks, `atomc calibrate`).

`atomc train` reads its data through the streaming, resumable readers beside this module
(`sources`, `stream`); these batches are drawn at random by step instead.

`stdlib_text()` reads the Python standard library's own source files (every Python
installation ships them), so the demo and `atomc train --data stdlib` train on real text
without a download. Tokens are bytes (a vocabulary of 256). `ByteBatches` cuts the text
into fixed-length windows and deals them out as batches, deterministically from a seed and
a step number, so that a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import torch

from atomc.data.model import token_input
from atomc.errors import UsageError


def stdlib_text(max_bytes: int = 8 << 20) -> bytes:
    """Up to `max_bytes` of the standard library's .py files, in a fixed (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise UsageError(f"no Python source files under {root}; give a text file instead")
    return b"\n".join(chunks)[:max_bytes]


class ByteBatches:
    """Batches of byte windows: `batch(step)` is the same tensor for the same (seed, step)."""

    def __init__(self, text: bytes, seq_len: int, batch_size: int, seed: int = 0,
                 holdout_fraction: float = 0.0):
        if len(text) < seq_len + 1:
            raise UsageError(f"the text has {len(text)} bytes, fewer than one window of "
                             f"{seq_len + 1}")
        self.tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
        split = int(len(self.tokens) * (1 - holdout_fraction))
        self.train_tokens = self.tokens[:split]
        self.holdout_tokens = self.tokens[split:]
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed

    def _windows(self, tokens: torch.Tensor, gen: torch.Generator, n: int) -> torch.Tensor:
        starts = torch.randint(0, len(tokens) - self.seq_len, (n,), generator=gen)
        return torch.stack([tokens[s:s + self.seq_len] for s in starts.tolist()])

    def batch(self, step: int) -> torch.Tensor:
        """[batch_size, seq_len] int64 windows of the training text for `step`."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return self._windows(self.train_tokens, gen, self.batch_size)

    def holdout(self, n: int) -> torch.Tensor:
        if len(self.holdout_tokens) < self.seq_len + 1:
            raise UsageError("no held-out text: give holdout_fraction > 0")
        gen = torch.Generator().manual_seed(self.seed + 7)
        return self._windows(self.holdout_tokens, gen, n)


def text_batches(trainer: Any, data: str = "stdlib", seed: int = 0) -> ByteBatches:
    """Byte-level batches of C micro-batches for `trainer`'s package (one integer input of
    shape [batch, sequence]): the standard library's sources ("stdlib") or a text file.
    UsageError for a package with other inputs (train it through the Python API)."""
    _, shape, _ = token_input(trainer.package)
    if data == "stdlib":
        text = stdlib_text()
    else:
        try:
            text = Path(data).read_bytes()
        except OSError as e:
            raise UsageError(f"cannot read the text file {data} ({e.strerror or e}); give a "
                             f"readable file or 'stdlib'") from None
    return ByteBatches(text, seq_len=shape[1], batch_size=trainer.accum * shape[0], seed=seed)
