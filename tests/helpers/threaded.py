"""Layout stages (resident or swapped) run on threads of this process, one at a time, wired by
in-process queues: a pipeline without processes or sockets (test_layout_swap,
test_boundary_grads). A stage hands on the turn only while it waits for a neighbour: the
generators that dropout draws from are the process's, which two stages computing at once
would share.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch


class _Turn:
    """One stage computes at a time; a stage gives the turn up while it waits."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def wait(self, q: queue.Queue) -> Any:
        self.lock.release()
        try:
            return q.get(timeout=10)
        finally:
            self.lock.acquire()


class _Wire:
    def __init__(self) -> None:
        self.values: queue.Queue = queue.Queue()
        self.grads: queue.Queue = queue.Queue()


class _Links:
    """A stage's S and R over in-process queues (copies, as a wire would make)."""

    def __init__(self, before: _Wire | None, after: _Wire | None, turn: _Turn):
        self.before, self.after, self.turn = before, after, turn

    def recv(self, m: int) -> dict[str, Any]:
        return self.turn.wait(self.before.values)

    def send(self, m: int, values: dict[str, Any]) -> None:
        self.after.values.put({n: v.detach().clone() if isinstance(v, torch.Tensor) else v
                               for n, v in values.items()})

    def recv_grads(self, m: int) -> dict[str, torch.Tensor]:
        return self.turn.wait(self.after.grads)

    def send_grads(self, m: int, grads: dict[str, Any], received: dict[str, Any]) -> None:
        self.before.grads.put({n: g.detach().clone() for n, g in grads.items() if g is not None})


def train_on_threads(stages: list[Any], lists: list[list[Any]], num_micro: int, steps: int,
                     micro_batches: Callable[[int], list[tuple]]) -> list[float]:
    """Each step's mean loss of `stages` (one replica: stage j runs action list `lists[j]`)
    trained for `steps` steps of `num_micro` micro-batches, `micro_batches(step)` giving them."""
    wires = [_Wire() for _ in range(len(stages) - 1)]
    turn = _Turn()
    links = [_Links(wires[j - 1] if j > 0 else None, wires[j] if j < len(wires) else None, turn)
             for j in range(len(stages))]
    losses: list[float] = []
    errors: list[BaseException | None] = [None] * len(stages)

    def run(j: int) -> None:
        st = stages[j]
        turn.lock.acquire()
        try:
            for s in range(steps):
                st.begin_step(s, num_micro)
                out = st.run(lists[j], micro_batches(s), links[j])
                st.optimizer_step(None)
                if st.spec.holds_output:
                    losses.append(float(torch.stack(out).to(torch.float64).sum()) / num_micro)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors[j] = e
        finally:
            turn.lock.release()

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(len(stages))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "a stage did not finish within 60 s"
    for e in errors:
        if e is not None:
            raise e
    return losses
