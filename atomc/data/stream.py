"""Training data, packing: a source's token ids -> batches of fixed-length sequences.

`TokenStream` reads a source's pieces one after another as one run of ids, starting again
at the beginning (a new epoch) when the source ends; its `position()` names the piece and the
offset in it that the next id comes from, and `seek(position)` returns there by reading from
that piece on, so a run resumed from a checkpoint sees exactly the ids an uninterrupted run
would have seen, without reading what came before.

`PackedBatches` cuts that run into sequences of the plan's length, `rows` of them per batch,
in order (no padding, nothing dropped; a document may span two sequences, as Hugging Face's
run_clm and nanoGPT pack), and refuses an id the model cannot look up (`check_ids`, the one
place that says so).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from atomc.data.sources import Source
from atomc.errors import UsageError

POSITION_KIND = "atomc.data-position"


class TokenStream:
    """The ids of `source`, piece after piece, epoch after epoch (see the module docstring)."""

    def __init__(self, source: Source, min_ids: int = 1):
        self.source = source
        # fewer ids than this in the whole source are refused when it first ends: one
        # sequence of a packed batch would be the data repeated (an 8-byte file as 64 bytes)
        self.min_ids = min_ids
        self.epoch = 0
        self.tokens = 0  # ids taken so far, over every epoch
        self._pieces: Iterator[tuple[int, np.ndarray]] | None = None
        self._start = 0  # position of the current piece
        self._piece = np.zeros(0, dtype=np.int64)
        self._offset = 0  # ids of the current piece already taken
        self._taken_this_epoch = 0
        self._resumed = False  # by seek: ids before the position were not counted

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "piece": self._start, "offset": self._offset,
                "tokens": self.tokens}

    def seek(self, position: dict[str, int]) -> None:
        """Continue from `position` (from position()): the piece that starts there, less the
        ids of it already taken."""
        self.epoch = int(position["epoch"])
        self.tokens = int(position["tokens"])
        self._pieces = self.source.pieces(int(position["piece"]))
        self._taken_this_epoch = 1  # not an empty source: ids were taken from it before
        self._resumed = True
        self._piece = np.zeros(0, dtype=np.int64)
        self._offset = 0
        want = int(position["offset"])
        start, piece = next(self._pieces, (int(position["piece"]), None))
        if piece is None or start != int(position["piece"]) or len(piece) < want:
            raise UsageError(f"{self.source.description} has no piece at position "
                             f"{position['piece']} with {want} ids: it changed since the "
                             f"checkpoint was written; start the data again (leave out "
                             f"--resume) or give the data the run was trained on")
        self._start, self._piece, self._offset = start, piece, want

    def _next_piece(self) -> None:
        if self._pieces is None:
            self._pieces = self.source.pieces(0)
        for start, piece in self._pieces:
            if len(piece):
                self._start, self._piece, self._offset = start, piece, 0
                self._taken_this_epoch += len(piece)
                return
        if not self._taken_this_epoch:
            raise UsageError(f"{self.source.description} holds no token ids")
        if self.epoch == 0 and not self._resumed and self._taken_this_epoch < self.min_ids:
            raise UsageError(
                f"{self.source.description} holds {self._taken_this_epoch} token ids, fewer "
                f"than one sequence of the plan ({self.min_ids} ids): give more data (or a "
                f"package planned for shorter sequences)")
        self.epoch += 1
        self._taken_this_epoch = 0
        self._pieces = self.source.pieces(0)
        self._next_piece()

    def take(self, n: int) -> np.ndarray:
        """The next `n` ids (int64)."""
        out = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            if self._offset >= len(self._piece):
                self._next_piece()
            part = self._piece[self._offset:self._offset + n - filled]
            out[filled:filled + len(part)] = part
            filled += len(part)
            self._offset += len(part)
        self.tokens += n
        return out


def check_ids(ids: np.ndarray | torch.Tensor, vocab: int | None, where: str, model: str,
              byte_level: bool = False) -> None:
    """Refuse token ids that `model`, with a vocabulary of `vocab` ids, cannot look up. The one
    check of data against the model: an id out of range is an IndexError on the CPU, and on a
    GPU a device-side assertion that ends the process."""
    if vocab is None or len(ids) == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < vocab:
        return
    bad = high if high >= vocab else low
    if byte_level:
        raise UsageError(
            f"{where}: byte value {bad} is not a token id of {model}, whose vocabulary has "
            f"{vocab} ids (0-{vocab - 1}); byte-level text needs all of 0-255: give the "
            f"model's own data, token ids (--data train.bin) or text with its tokenizer "
            f"(--tokenizer DIR)")
    raise UsageError(
        f"{where}: token id {bad} is outside the vocabulary of {model} (0-{vocab - 1}, "
        f"{vocab} ids); give data tokenized for this model (its tokenizer, or ids below "
        f"{vocab})")


def check_tokenizer(source: Source, vocab: int | None, model: str) -> None:
    """Refuse a tokenizer with more ids than the model can look up."""
    size = source.tokenizer_size
    if vocab is None or size is None or size <= vocab:
        return
    raise UsageError(f"{source.description}: its tokenizer has {size} ids, but {model} looks "
                     f"up {vocab} (0-{vocab - 1}); give the tokenizer the model was made for")


class PackedBatches:
    """Batches [rows, seq_len] of consecutive ids of `source` (see the module docstring)."""

    def __init__(self, source: Source, rows: int, seq_len: int, *,
                 dtype: torch.dtype = torch.int64, vocab: int | None = None,
                 model: str = "the model"):
        self.source = source
        self.stream = TokenStream(source, min_ids=seq_len)
        self.rows = rows
        self.seq_len = seq_len
        self.dtype = dtype
        self.vocab = vocab
        self.model = model
        check_tokenizer(source, vocab, model)

    @property
    def tokens_per_batch(self) -> int:
        return self.rows * self.seq_len

    def next(self) -> torch.Tensor:
        ids = self.stream.take(self.tokens_per_batch)
        check_ids(ids, self.vocab, self.source.description, self.model,
                  byte_level=self.source.identity.get("format") == "bytes")
        return torch.from_numpy(ids.reshape(self.rows, self.seq_len)).to(self.dtype)

    def position(self) -> dict[str, Any]:
        """Where the next batch starts, with what it is a position in (for a checkpoint)."""
        return {"kind": POSITION_KIND, "source": dict(self.source.identity),
                "seq_len": self.seq_len, **self.stream.position()}

    def resume(self, saved: Any) -> str:
        """Continue from a position() a checkpoint kept; returns what was done, in words. A
        position of other data (another file, format or tokenizer, a file that changed size)
        or none at all starts this data at its beginning."""
        if not isinstance(saved, dict) or saved.get("kind") != POSITION_KIND:
            return (f"the checkpoint records no data position: {self.source.description} "
                    f"starts at its beginning")
        if saved.get("source") != self.source.identity or saved.get("seq_len") != self.seq_len:
            return (f"the checkpoint's data position is in other data "
                    f"({saved.get('source', {}).get('path', '?')}): "
                    f"{self.source.description} starts at its beginning")
        self.stream.seek(saved)
        return (f"data: continuing {self.source.description} at token {self.stream.tokens:,} "
                f"(epoch {self.stream.epoch})")


def held_out(source: Source, rows: int, seq_len: int, batches: int, *,
             dtype: torch.dtype = torch.int64, vocab: int | None = None,
             model: str = "the model") -> list[torch.Tensor]:
    """The first `batches` batches of `source` (fewer when it ends before), read once: the same
    held-out batches at every evaluation, so that the losses compare."""
    data = PackedBatches(source, rows, seq_len, dtype=dtype, vocab=vocab, model=model)
    out = []
    for _ in range(batches):
        batch = data.next()
        if data.stream.epoch > 0:
            break  # the data ended inside this batch, which wrapped around to its beginning
        out.append(batch)
    if not out:
        raise UsageError(f"{source.description} holds fewer token ids than one batch "
                         f"({rows} sequences of {seq_len} = {rows * seq_len} ids); give more "
                         f"held-out data")
    return out


__all__ = ["PackedBatches", "TokenStream", "check_ids", "check_tokenizer", "held_out"]
