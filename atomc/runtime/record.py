"""Runtime stage, the record of a run: what `atomc train --log-dir DIR` writes as it trains.

`DIR/metrics.jsonl`, one JSON object a line, flushed line by line (a crash loses at most the
line being written), appended to when a resumed run logs to the same directory:
- {"kind": "run", ...}: the run's settings (package, device, C, micro-batch, sequence length,
  tokens per step, data), once per start;
- {"kind": "train", "step": s, "loss", "lr", "grad_norm", "tokens_per_s", "device_busy",
  "step_ms", "tokens"}: every `--log-every` steps; `step` counts steps done (1 after the first),
  as TensorBoard's x axis; `device_busy` is the fraction of the step's device time its compute
  lane was busy, from the step's measured trace (CUDA events on a GPU, host clocks on the CPU);
  `tokens_per_s` counts the ids fed since the previous record over the wall time between them;
- {"kind": "eval", "step": s, "loss"}: the held-out loss.
A value that is not finite (an overflowing step's gradient norm) is written as null. A run
resumed from a checkpoint at step s first drops the lines of steps after s (a crashed run's
tail, which it records again).

With `tensorboard=True` the same scalars go to TensorBoard event files in DIR
(torch.utils.tensorboard, which needs the tensorboard package): train/loss, train/lr,
train/grad_norm, train/tokens_per_s, train/device_busy, eval/loss. A resumed run drops the
events of steps after its checkpoint (SummaryWriter's purge_step), so that a crashed run's
tail is not drawn twice.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import IO, Any

from atomc.errors import UsageError
from atomc.jsonio import write_atomic

METRICS = "metrics.jsonl"


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def summary_writer_class() -> Any:
    """torch.utils.tensorboard.SummaryWriter; UsageError when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard "
                         "\"torch==<your torch>\" (the JSONL record in --log-dir is written "
                         "without it: leave out --tensorboard)") from None
    return SummaryWriter


def _drop_after(path: Path, step: int) -> None:
    """Rewrite the record without its lines of steps after `step` (atomically): a resumed
    run records them again."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            done = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a line cut short by a crash
        if not isinstance(done, int) or done <= step:
            kept.append(line)
    if len(kept) != len(lines):
        write_atomic(path, "".join(kept))


class RunRecord:
    """Appends a run's metrics to DIR/metrics.jsonl, and to TensorBoard when asked."""

    def __init__(self, log_dir: str | Path, *, tensorboard: bool = False, start_step: int = 0):
        writer_class = summary_writer_class() if tensorboard else None
        self.dir = Path(log_dir)
        if self.dir.exists() and not self.dir.is_dir():
            raise UsageError(f"--log-dir {self.dir} is a file; give a directory")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if start_step:
                _drop_after(self.dir / METRICS, start_step)
            self._file: IO[str] = open(self.dir / METRICS, "a", encoding="utf-8")
        except OSError as e:
            raise UsageError(f"cannot write the record in {self.dir} ({e.strerror or e}); give "
                             f"a writable --log-dir") from None
        self.writer = (writer_class(log_dir=str(self.dir), flush_secs=30,
                                    purge_step=start_step + 1 if start_step else None)
                       if writer_class is not None else None)
        self._last_time = time.perf_counter()
        self._last_tokens: int | None = None

    def _line(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _plain(v) for k, v in obj.items()}) + "\n")
        self._file.flush()

    def run(self, **settings: Any) -> None:
        self._line({"kind": "run", **settings})

    def start(self, tokens: int) -> None:
        """The clock and token count that the next record's throughput is measured from."""
        self._last_time = time.perf_counter()
        self._last_tokens = tokens

    def train(self, step: int, *, loss: float, lr: float, grad_norm: float | None,
              tokens: int, device_busy: float | None, step_ms: float | None) -> dict[str, Any]:
        """Record step `step` (steps done); `tokens`: ids fed so far. Returns the line."""
        now = time.perf_counter()
        rate = None
        if self._last_tokens is not None and now > self._last_time:
            rate = (tokens - self._last_tokens) / (now - self._last_time)
        self._last_time, self._last_tokens = now, tokens
        line = {"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens_per_s": rate, "device_busy": device_busy, "step_ms": step_ms,
                "tokens": tokens}
        self._line(line)
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "device_busy"):
                value = line[key]
                if value is not None and math.isfinite(value):
                    self.writer.add_scalar(f"train/{key}", value, step)
        return line

    def eval(self, step: int, loss: float) -> None:
        self._line({"kind": "eval", "step": step, "loss": loss})
        if self.writer is not None and math.isfinite(loss):
            self.writer.add_scalar("eval/loss", loss, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self._file.close()


__all__ = ["METRICS", "RunRecord", "summary_writer_class"]
