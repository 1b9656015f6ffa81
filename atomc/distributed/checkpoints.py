"""The layout runner's checkpoints: one file per tasklet (replica, stage) per step under
step_NNNNNNNN/, the newest step every rank holds resumed, the oldest removed; and the stages'
final weights merged into the original model's (`final_state`).
"""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from atomc.errors import RuntimeMismatchError
from atomc.jsonio import write_atomic
from atomc.runtime.checkpoint import load_checkpoint, save_checkpoint


class TaskletCheckpoints:
    """LayoutTrainer's checkpoints of its tasklet."""

    def _ckpt_name(self) -> str:
        return f"replica_{self.place.replica}.stage_{self.place.stage}.pt"

    def _tasklet_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "kind": "atomc.layout-tasklet",
            "step": self.step_count,
            "replica": self.place.replica,
            "stage": self.place.stage,
            "submodels": list(self.place.submodels),
            "plan_hash": self.pkg.plan_hash,
            "package": self.pkg.fingerprint(),
            "layout": [self.layout.pp, self.layout.dp, [list(r) for r in self.layout.stage_ranges]],
            "executor": self.stage.kind,
            "losses": {str(k): v for k, v in self.losses.items()},
        }
        state["stage_state"] = self.stage.state_dict()
        state["unread"] = self.unread
        return state

    def save_checkpoint(self) -> Path:
        root = Path(self.cfg.checkpoint_dir)
        path = root / f"step_{self.step_count:08d}" / self._ckpt_name()
        save_checkpoint(path, self._tasklet_state())
        self.dist.barrier()  # nobody runs ahead by more than one checkpoint: two kept are enough
        mine = sorted(own_steps(root, self._ckpt_name()))
        for s in mine[:-max(1, self.cfg.keep_checkpoints)]:
            f = root / f"step_{s:08d}" / self._ckpt_name()
            f.unlink(missing_ok=True)
            _remove_if_empty(f.parent)
        return path

    def resume(self) -> int | None:
        """Load the newest checkpoint every rank has; returns its step (None: nothing to resume)."""
        if not self.cfg.checkpoint_dir:
            return None
        root = Path(self.cfg.checkpoint_dir)
        mine = own_steps(root, self._ckpt_name())
        newest = torch.tensor([max(mine) if mine else -1], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(newest, op=self.dist.ReduceOp.MIN)
        step = int(newest.item())
        if step < 0:
            return None
        path = root / f"step_{step:08d}" / self._ckpt_name()
        state = load_checkpoint(path)
        self._check_tasklet_state(state, path)
        self.stage.load_state_dict(state["stage_state"])
        self.unread = dict(state.get("unread", {}))  # absent from older checkpoints
        self.step_count = int(state["step"])
        self.losses = {int(k): float(v) for k, v in state.get("losses", {}).items()}
        self.resumed_from = step
        if self.cfg.metrics_path is not None and self.place.replica == 0 and self.spec.holds_output:
            _truncate_metrics(Path(self.cfg.metrics_path), step)
        return step

    def _check_tasklet_state(self, state: Any, path: Path) -> None:
        if not isinstance(state, dict) or state.get("kind") != "atomc.layout-tasklet":
            raise RuntimeMismatchError(f"{path} is not a layout checkpoint; give the checkpoint "
                                       f"directory a layout run wrote")
        want = (self.pkg.plan_hash, self.pkg.fingerprint(), self.place.replica, self.place.stage,
                list(self.place.submodels))
        got = (state.get("plan_hash"), state.get("package"), state.get("replica"),
               state.get("stage"), list(state.get("submodels", [])))
        if got != want:
            raise RuntimeMismatchError(
                f"{path} holds plan {got[0]} (package {got[1]}), replica {got[2]} stage {got[3]} "
                f"sub-models {got[4]}, but this rank runs plan {want[0]} (package {want[1]}), "
                f"replica {want[2]} stage {want[3]} sub-models {want[4]}; resume with the package "
                f"and layout that wrote it, or use a new --checkpoint-dir")
        if state.get("executor") != self.stage.kind:
            raise RuntimeMismatchError(
                f"{path} was written by a {state.get('executor')} stage but this stage runs "
                f"{self.stage.kind}; resume with the same --swap-stages and memory budget")


def own_steps(root: Path, name: str) -> list[int]:
    steps = []
    if not root.is_dir():
        return steps
    for d in root.glob("step_*"):
        try:
            s = int(d.name[5:])
        except ValueError:
            continue
        if (d / name).is_file():
            steps.append(s)
    return steps


def _remove_if_empty(d: Path) -> None:
    try:
        leftovers = [p for p in d.iterdir() if not p.name.startswith(".")]
        if not leftovers:
            shutil.rmtree(d, ignore_errors=True)
    except FileNotFoundError:
        pass


def _truncate_metrics(path: Path, step: int) -> None:
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < step:
                keep.append(line)
        except (ValueError, KeyError):
            continue
    write_atomic(path, "".join(k + "\n" for k in keep))


def final_state(final_dir: str | Path, num_stages: int, buffers: dict | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """Merge the stages' final weights (and the last stage's losses) written by `run_layout`;
    `buffers`, a dict, receives the stages' buffers by FQN. The weights carry torch's
    `_metadata` (the modules' state-dict format versions), as `model.state_dict()` does:
    add the buffers to them (`params.update(buffers)`) to load both."""
    params: dict[str, torch.Tensor] = OrderedDict()
    losses: dict[int, float] = {}
    metadata: dict[str, dict] = {}
    for j in range(num_stages):
        st = load_checkpoint(Path(final_dir) / f"final_stage_{j}.pt")
        for k, v in {**st.get("unread", {}), **st["params"]}.items():
            params.setdefault(k, v)
        if buffers is not None:
            buffers.update(st.get("buffers", {}))
        metadata.update(st.get("metadata", {}))
        if st["losses"]:
            losses = {int(k): float(v) for k, v in st["losses"].items()}
    params._metadata = OrderedDict(sorted(metadata.items()))  # type: ignore[attr-defined]
    return params, losses


__all__ = ["TaskletCheckpoints", "final_state", "own_steps"]
