"""Training data, readers: a data set on disk -> token ids, one piece at a time.

`open_source(path, ...)` reads:
- token ids: a flat binary of one integer dtype (nanoGPT's train.bin / val.bin: uint16 for
  GPT-2's 50257 ids, uint32 above 65535), its dtype given (`dtype=`, `--data-dtype`) or read
  from a sidecar `PATH.json` ({"dtype": "uint16"}); or a .npy array, whose header names its
  dtype. Both through numpy.memmap.
- text: its bytes as ids 0-255 without a tokenizer; with one, blocks of whole lines (about
  1 MiB each), each tokenized on its own (no special tokens: the text runs on).
- JSONL: one JSON object per line, its `text_field` tokenized, the tokenizer's end-of-text id
  after each document (when it has one and did not put it there).
- a `datasets` dataset saved with `save_to_disk`: rows of token ids (an `input_ids` column),
  or of text (`text_field`) given a tokenizer; of a DatasetDict, the "train" split for
  training and "validation" (else "test") for evaluation.

A source yields pieces (token-file chunks, text blocks, documents, rows), each with the
position it starts at (a token index, a byte offset, a row index), and reads again from any
such position without reading what came before: `pieces(position)`. Only one piece is held at
a time, so a data set larger than memory streams, and a resumed run starts where it stopped.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from atomc.errors import UsageError

FORMATS = ("tokens", "text", "jsonl", "dataset")
TOKEN_DTYPES = ("uint8", "uint16", "int16", "uint32", "int32", "int64")
CHUNK = 1 << 20  # token ids per piece of a token file
TEXT_BLOCK = 1 << 20  # bytes of whole lines per tokenized block of a text file
DOC_BATCH = 64  # documents (JSONL lines, dataset rows) per tokenizer call
IDS_COLUMN = "input_ids"


@dataclass
class Source:
    """Token ids in pieces: `pieces(start)` yields (position, ids) from position `start` on
    (0: the beginning); a yielded position is one to read again from."""

    description: str  # for messages: "train.bin (uint16 token ids)"
    identity: dict[str, Any]  # what a saved position must match to be resumed here
    tokenizer_size: int | None = None  # len(tokenizer), when ids come from one
    _reader: Any = field(default=None, repr=False)

    def pieces(self, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        return self._reader(start)


# ---- token ids ---------------------------------------------------------------------------------


def _array_pieces(ids: np.ndarray) -> Any:
    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        for a in range(start, len(ids), CHUNK):
            yield a, np.asarray(ids[a:a + CHUNK])
    return read


def _file_identity(p: Path, fmt: str, **more: Any) -> dict[str, Any]:
    st = p.stat()
    return {"format": fmt, "path": str(p.resolve()), "bytes": st.st_size, **more}


def _sidecar_dtype(p: Path) -> str | None:
    side = p.with_name(p.name + ".json")
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {side} ({e}); it must be JSON such as "
                         f'{{"dtype": "uint16"}}') from None
    if not isinstance(meta, dict) or "dtype" not in meta:
        raise UsageError(f'{side} has no "dtype"; write {{"dtype": "uint16"}} (the dtype the '
                         f"token ids of {p.name} were written with)")
    return str(meta["dtype"])


def token_file(path: str | os.PathLike, dtype: str | None = None) -> Source:
    """A flat binary of token ids (dtype given, else from PATH.json) or a .npy array."""
    p = Path(path)
    if p.suffix == ".npy":
        try:
            ids = np.load(p, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot read {p} as a .npy array ({e}); give an array saved "
                             f"with numpy.save") from None
        if ids.dtype.kind not in "iu":
            raise UsageError(f"{p} holds {ids.dtype} values; token ids are integers: save "
                             f"them as uint16, uint32 or int64")
        ids = ids.reshape(-1)
        name = str(ids.dtype)
    else:
        name = dtype or _sidecar_dtype(p)
        if name is None:
            raise UsageError(
                f"{p}: the dtype of its token ids is unknown; give --data-dtype (uint16 for "
                f"ids below 65536, as nanoGPT's train.bin; uint32 above) or write "
                f'{p.name}.json beside it with {{"dtype": "uint16"}}')
        if name not in TOKEN_DTYPES:
            raise UsageError(f"token dtype {name!r} is not one of {', '.join(TOKEN_DTYPES)}")
        size = p.stat().st_size
        width = np.dtype(name).itemsize
        if size % width:
            raise UsageError(
                f"{p} has {size} bytes, not a multiple of {width} ({name} token ids): it was "
                f"written with another dtype or cut short; give the dtype it was written with "
                f"(--data-dtype) or write it again")
        if size == 0:
            raise UsageError(f"{p} is empty; give a file of token ids")
        ids = np.memmap(p, dtype=name, mode="r")
    if len(ids) == 0:
        raise UsageError(f"{p} holds no token ids")
    return Source(f"{p} ({name} token ids)", _file_identity(p, "tokens", dtype=name),
                  _reader=_array_pieces(ids))


def byte_text(path: str | os.PathLike) -> Source:
    """A file's bytes as token ids 0-255 (a byte-level language model)."""
    p = Path(path)
    if p.stat().st_size == 0:
        raise UsageError(f"{p} is empty; give a text file")
    ids = np.memmap(p, dtype=np.uint8, mode="r")
    return Source(f"{p} (bytes)", _file_identity(p, "bytes"), _reader=_array_pieces(ids))


def stdlib_bytes() -> Source:
    """The Python standard library's sources as bytes (atomc.data.text.stdlib_text)."""
    from atomc.data.text import stdlib_text
    text = stdlib_text()
    ids = np.frombuffer(text, dtype=np.uint8)
    return Source("the Python standard library's sources (bytes)",
                  {"format": "bytes", "path": "stdlib", "bytes": len(text)},
                  _reader=_array_pieces(ids))


# ---- tokenizers --------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A transformers tokenizer from a local directory (or a tokenizer.json file); nothing is
    downloaded."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"tokenizer {p} does not exist; give a local directory written by "
                         f"save_pretrained (tokenizer.json, tokenizer_config.json) or a "
                         f"tokenizer.json file: nothing is downloaded")
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise UsageError("--tokenizer needs the transformers package: pip install transformers "
                         "\"torch==<your torch>\"") from None
    try:
        if p.is_file():
            return PreTrainedTokenizerFast(tokenizer_file=str(p))
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to load is the user's directory
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UsageError(f"cannot load a tokenizer from {p} ({type(e).__name__}"
                         f"{': ' + why if why else ''}); give a directory written by "
                         f"save_pretrained or a tokenizer.json file") from None


def _tokenizer_identity(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "")) or type(tokenizer).__name__


def _encode_documents(tokenizer: Any, texts: list[str]) -> list[np.ndarray]:
    """Each document's ids (the tokenizer's own special tokens included), with the
    end-of-text id after it when the tokenizer has one and did not put it there."""
    eos = getattr(tokenizer, "eos_token_id", None)
    out = []
    for ids in tokenizer(texts, verbose=False)["input_ids"]:
        if eos is not None and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        out.append(np.asarray(ids, dtype=np.int64))
    return out


def tokenized_text(path: str | os.PathLike, tokenizer: Any) -> Source:
    """A text file, tokenized in blocks of whole lines as it is read."""
    p = Path(path)

    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        with open(p, "rb") as f:
            f.seek(start)
            pos = start
            while True:
                block = b"".join(f.readlines(TEXT_BLOCK))
                if not block:
                    return
                try:
                    text = block.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise UsageError(f"{p} is not UTF-8 text at byte {pos + e.start}; give "
                                     f"UTF-8 text, or leave out --tokenizer to train on its "
                                     f"bytes") from None
                ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
                yield pos, np.asarray(ids, dtype=np.int64)
                pos += len(block)

    return Source(f"{p} (text, tokenized)",
                  _file_identity(p, "text", tokenizer=_tokenizer_identity(tokenizer)),
                  tokenizer_size=len(tokenizer), _reader=read)


def jsonl_documents(path: str | os.PathLike, tokenizer: Any, text_field: str = "text"
                    ) -> Source:
    """A JSONL file: each line's `text_field`, tokenized, one document per line."""
    p = Path(path)

    def text_of(line: bytes, offset: int) -> str:
        try:
            record = json.loads(line)
        except ValueError as e:
            raise UsageError(f"{p}: the line at byte {offset} is not JSON ({e}); give one "
                             f"JSON object per line") from None
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record)
            raise UsageError(f"{p}: the record at byte {offset} has no text field "
                             f"{text_field!r} (it has {keys or 'nothing'}); name the field "
                             f"with --text-field")
        return text

    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        with open(p, "rb") as f:
            f.seek(start)
            while True:
                batch: list[tuple[int, str]] = []
                while len(batch) < DOC_BATCH:
                    offset = f.tell()
                    line = f.readline()
                    if not line:
                        break
                    if line.strip():
                        batch.append((offset, text_of(line, offset)))
                if not batch:
                    return
                docs = _encode_documents(tokenizer, [t for _, t in batch])
                for (offset, _), ids in zip(batch, docs):
                    yield offset, ids

    return Source(f"{p} (JSONL {text_field!r}, tokenized)",
                  _file_identity(p, "jsonl", tokenizer=_tokenizer_identity(tokenizer),
                                 field=text_field),
                  tokenizer_size=len(tokenizer), _reader=read)


# ---- datasets ----------------------------------------------------------------------------------


def saved_dataset(path: str | os.PathLike, tokenizer: Any = None, text_field: str = "text",
                  role: str = "train") -> Source:
    """A dataset written by `save_to_disk` (a DatasetDict: the split for `role`)."""
    p = Path(path)
    try:
        import datasets
    except ImportError:
        raise UsageError(f"{p} is a directory, read as a datasets dataset, which needs the "
                         f"datasets package: pip install datasets \"torch==<your torch>\" "
                         f"(or give a token file, a text file or a JSONL file)") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # noqa: BLE001 - anything but a saved dataset
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise UsageError(f"{p} is not a dataset written by save_to_disk ({type(e).__name__}"
                         f"{': ' + why if why else ''}); give such a directory, or a token, "
                         f"text or JSONL file") from None
    split = None
    if isinstance(ds, datasets.DatasetDict):
        wanted = ("train",) if role == "train" else ("validation", "test")
        split = next((s for s in wanted if s in ds), None)
        if split is None:
            raise UsageError(f"{p} holds the splits {', '.join(ds)}, none of them "
                             f"{' or '.join(wanted)}; save the one to use on its own "
                             f"(ds[split].save_to_disk(...)) and give that directory")
        ds = ds[split]
    columns = list(ds.column_names)
    if tokenizer is not None and text_field in columns:
        column, tokenize = text_field, True
    elif IDS_COLUMN in columns:
        column, tokenize = IDS_COLUMN, False
    elif text_field in columns:
        raise UsageError(f"{p}: its rows are text ({text_field!r}); give the tokenizer to "
                         f"read them with (--tokenizer DIR)")
    else:
        raise UsageError(f"{p} has the columns {', '.join(columns)}, neither {IDS_COLUMN!r} "
                         f"(token ids) nor a text column {text_field!r}; name the text column "
                         f"with --text-field")
    where = f"{p}{f' [{split}]' if split else ''}"

    def read(start: int) -> Iterator[tuple[int, np.ndarray]]:
        for a in range(start, len(ds), DOC_BATCH):
            rows = ds[a:a + DOC_BATCH][column]
            if tokenize:
                docs = _encode_documents(tokenizer, rows)
            else:
                docs = [np.asarray(r, dtype=np.int64).reshape(-1) for r in rows]
            for j, ids in enumerate(docs):
                yield a + j, ids

    ident = {"format": "dataset", "path": str(p.resolve()), "split": split, "rows": len(ds),
             "fingerprint": getattr(ds, "_fingerprint", None), "column": column}
    if tokenize:
        ident["tokenizer"] = _tokenizer_identity(tokenizer)
    return Source(f"{where} ({column!r}{', tokenized' if tokenize else ''})", ident,
                  tokenizer_size=len(tokenizer) if tokenize else None, _reader=read)


# ---- one entry ---------------------------------------------------------------------------------


def data_format(path: str, fmt: str | None = None) -> str:
    """The format of `path`: given, else from what it is (a directory: a dataset) and its
    suffix (.bin / .npy: token ids, .jsonl: JSONL, anything else: text)."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise UsageError(f"data format {fmt!r} is not one of {', '.join(FORMATS)}")
        return fmt
    p = Path(path)
    if p.is_dir():
        return "dataset"
    suffix = p.suffix.lower()
    if suffix in (".bin", ".npy"):
        return "tokens"
    if suffix == ".jsonl":
        return "jsonl"
    return "text"


# what each format reads of the data options (a .npy array's header names its dtype)
_OPTIONS = {"tokens": ("--data-dtype",), "text": ("--tokenizer",),
            "jsonl": ("--tokenizer", "--text-field"), "dataset": ("--tokenizer", "--text-field"),
            "stdlib": ()}


def used_options(path: str, fmt: str | None = None) -> tuple[str, ...]:
    """The data options (`--data-dtype`, `--tokenizer`, `--text-field`) the reader of `path`
    reads: a flat token file its dtype, text a tokenizer, JSONL and datasets both of those
    and the text field."""
    if path == "stdlib":
        return _OPTIONS["stdlib"]
    kind = data_format(path, fmt)
    if kind == "tokens" and Path(path).suffix == ".npy":
        return ()
    return _OPTIONS[kind]


def check_options(paths: list[str], fmt: str | None, given: dict[str, bool]) -> None:
    """Refuse a data option (`given`: option -> whether it was given) that none of `paths`
    is read with: `--data-dtype uint16` beside a JSON file read as text would otherwise be
    dropped without a word."""
    used = {o for p in paths for o in used_options(p, fmt)}
    for option, was_given in given.items():
        if was_given and option not in used:
            kinds = ", ".join(f"{p} as {'bytes' if p == 'stdlib' else data_format(p, fmt)}"
                              for p in paths)
            readers = {"--data-dtype": "a flat token-id file (.bin)",
                       "--tokenizer": "text, JSONL or a dataset of text",
                       "--text-field": "JSONL or a dataset"}[option]
            raise UsageError(f"{option} is read only for {readers}, and the data is read "
                             f"{kinds}; leave {option} out, or give --data-format for the "
                             f"data's real format")


def open_source(path: str, *, fmt: str | None = None, dtype: str | None = None,
                tokenizer: Any = None, text_field: str = "text", role: str = "train") -> Source:
    """The reader for `path` ("stdlib": the Python standard library's sources, as bytes).
    `role` ("train" or "eval") picks a DatasetDict's split. Its first piece is read here, so
    that data a reader refuses (a record without its text field, no ids at all) is refused
    before anything else is built. An option its format does not read is refused."""
    check_options([path], fmt, {"--data-dtype": dtype is not None,
                                "--tokenizer": tokenizer is not None,
                                "--text-field": text_field != "text"})
    source = _open(path, fmt=fmt, dtype=dtype, tokenizer=tokenizer, text_field=text_field,
                   role=role)
    if not any(len(ids) for _, ids in itertools.islice(source.pieces(0), 64)):
        raise UsageError(f"{source.description} holds no token ids in its first pieces; give "
                         f"data with text or ids in it")
    return source


def _open(path: str, *, fmt: str | None, dtype: str | None, tokenizer: Any, text_field: str,
          role: str) -> Source:
    if path == "stdlib":
        if tokenizer is not None or fmt not in (None, "text"):
            raise UsageError("'stdlib' is the standard library's sources read as bytes; to "
                             "tokenize text, give a text or JSONL file")
        return stdlib_bytes()
    p = Path(path)
    if not p.exists():
        raise UsageError(f"data {p} does not exist; give a token file (.bin, .npy), a text "
                         f"or JSONL file, a dataset directory (save_to_disk) or 'stdlib'")
    kind = data_format(path, fmt)
    if kind != "dataset" and p.is_dir():
        raise UsageError(f"data {p} is a directory, not a {kind} file; give the file")
    if kind == "dataset":
        if not p.is_dir():
            raise UsageError(f"data {p} is a file; a dataset is the directory save_to_disk "
                             f"wrote")
        return saved_dataset(p, tokenizer, text_field, role)
    if kind == "tokens":
        return token_file(p, dtype)
    if kind == "jsonl":
        if tokenizer is None:
            raise UsageError(f"{p} is JSONL text; give the tokenizer to read it with "
                             f"(--tokenizer DIR)")
        return jsonl_documents(p, tokenizer, text_field)
    if tokenizer is None:
        return byte_text(p)
    return tokenized_text(p, tokenizer)


__all__ = ["FORMATS", "TOKEN_DTYPES", "Source", "byte_text", "check_options", "data_format",
           "jsonl_documents", "load_tokenizer", "open_source", "saved_dataset", "stdlib_bytes",
           "token_file", "tokenized_text", "used_options"]
