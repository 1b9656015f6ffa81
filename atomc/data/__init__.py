"""Training data for `atomc train`: a data set on disk -> the batches of a generated package.

- `sources`: readers, one piece at a time (token-id binaries and .npy arrays through
  numpy.memmap, text and JSONL through a local transformers tokenizer, `datasets` datasets
  saved to disk, bytes); `open_source(path, ...)` picks one.
- `stream`: `PackedBatches` packs a source into [rows, seq_len] batches, in order, and keeps
  its position for a checkpoint; `held_out` reads an evaluation set once; `check_ids` refuses
  ids the model cannot look up.
- `model`: `token_input(package)` (the integer input fed) and `model_vocabulary(package)`.
- `text`: byte-level text (`stdlib_text()`, the standard library's sources) cut into random
  windows by step (`ByteBatches`, `text_batches(trainer)`): the demo, benchmarks, calibration.

See docs/data.md.
"""

from atomc.data.model import model_vocabulary, token_input
from atomc.data.sources import FORMATS, TOKEN_DTYPES, Source, load_tokenizer, open_source
from atomc.data.stream import PackedBatches, TokenStream, check_ids, held_out

__all__ = [
    "FORMATS", "TOKEN_DTYPES", "PackedBatches", "Source", "TokenStream", "check_ids", "held_out",
    "load_tokenizer", "model_vocabulary", "open_source", "token_input",
]
