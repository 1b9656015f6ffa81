"""The action IR itself: `ActionKind`, `Action`, its text form (`parse_actions`,
`format_actions`) and `runs`/`phases` (see atomc.actions)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from atomc.errors import UsageError


class ActionKind(StrEnum):
    """What an action does; its value is the letter of the text form (and of JSON), so a kind
    compares equal to its letter ("F" == ActionKind.FORWARD)."""

    FORWARD = "F"
    BACKWARD = "B"
    LOAD = "L"
    OFFLOAD = "O"
    UPDATE = "U"
    SEND = "S"
    RECEIVE = "R"


# kinds that name a micro-batch
WITH_MICRO = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.SEND,
                        ActionKind.RECEIVE})
GRAMMAR = ("INDEX KIND [MICRO]: KIND one of F B S R with a micro-batch (2F0, 1S3), "
           "L O U without one (1L, 0U)")
_LETTERS = tuple(k.value for k in ActionKind)
_TOKEN = re.compile(r"(\d+)([A-Z])(\d*)")
_SEPARATORS = re.compile(r"[\s,]+")


@dataclass(frozen=True)
class Action:
    """One kind of work for sub-model or stage `index` (and micro-batch `micro`)."""

    kind: ActionKind  # given as an ActionKind or its letter
    index: int  # sub-model (swap runtime) or stage (pipeline orders)
    micro: int | None = None  # micro-batch for F, B, S, R; None for L, O, U

    def __post_init__(self) -> None:
        if self.kind not in _LETTERS:
            raise ValueError(f"action kind {self.kind!r} is not one of {' '.join(_LETTERS)}")
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.index < 0 or (self.micro is not None and self.micro < 0):
            raise ValueError(f"action {self.kind} {self.index} {self.micro}: negative number")
        if (self.micro is None) == (self.kind in WITH_MICRO):
            need = "needs" if self.kind in WITH_MICRO else "takes no"
            raise ValueError(f"action {self.kind} of {self.index} {need} micro-batch "
                             f"(got {self.micro})")

    def __str__(self) -> str:
        return f"{self.index}{self.kind}" + ("" if self.micro is None else str(self.micro))


def parse_actions(text: str) -> list[Action]:
    """The actions of a text form such as "0L 1L 0F0, 0F1"; UsageError names a bad token."""
    out = []
    for token in _SEPARATORS.split(text.strip()):
        if not token:
            continue
        match = _TOKEN.fullmatch(token)
        kind = match.group(2) if match else ""
        if kind not in _LETTERS or bool(match.group(3)) != (kind in WITH_MICRO):
            raise UsageError(f"schedule token {token!r} is not an action; expected {GRAMMAR}")
        index, micro = int(match.group(1)), match.group(3)
        out.append(Action(kind, index, int(micro) if micro else None))
    return out


def format_actions(actions, per_line: int | None = None) -> str:
    """The text form: tokens separated by spaces, `per_line` to a line when given."""
    tokens = [str(a) for a in actions]
    if not per_line:
        return " ".join(tokens)
    return "\n".join(" ".join(tokens[i:i + per_line]) for i in range(0, len(tokens), per_line))


Run = tuple[ActionKind, int, range | None]  # (kind, index, micro-batches); see runs()


def runs(actions) -> list[Run]:
    """Consecutive actions of one kind and index over consecutive micro-batches, as
    (kind, index, range of micro-batches), or (kind, index, None) for an L, O or U: the
    compact shape the simulator times (a lane runs a run back to back)."""
    out: list[Run] = []
    for a in actions:
        if out and a.micro is not None:
            kind, index, micros = out[-1]
            if (kind, index) == (a.kind, a.index) and micros is not None and micros.stop == a.micro:
                out[-1] = (kind, index, range(micros.start, a.micro + 1))
                continue
        out.append((a.kind, a.index, None if a.micro is None else range(a.micro, a.micro + 1)))
    return out


def phases(actions) -> list[list[Action]]:
    """The list cut where the compute moves on to another sub-model, for reading it a phase
    to a line: a load belongs to the compute after it (it is issued for it), an offload or
    update to the sub-model it names, which has just computed."""
    owners: list[int] = []
    following = None
    for a in reversed(actions):
        if a.kind in ("F", "B"):
            following = a.index
        owners.append(following if a.kind == "L" else a.index)
    owners.reverse()
    out: list[list[Action]] = []
    previous = None
    for a, owner in zip(actions, owners):
        if out and owner in (previous, None):
            out[-1].append(a)
        else:
            out.append([a])
        previous = owner if owner is not None else previous
    return out


def directions(actions: list[Action]) -> list[str | None]:
    """For each S and R action: "values" (activations forward) or "grads" (gradients back).
    A receive before its micro-batch's first forward brings values, after it gradients; a send
    before its micro-batch's first backward sends values, after it gradients."""
    forwarded: set[int | None] = set()
    backwarded: set[int | None] = set()
    out: list[str | None] = []
    for a in actions:
        if a.kind == "R":
            out.append("grads" if a.micro in forwarded else "values")
        elif a.kind == "S":
            out.append("grads" if a.micro in backwarded else "values")
        else:
            out.append(None)
            if a.kind == "F":
                forwarded.add(a.micro)
            elif a.kind == "B":
                backwarded.add(a.micro)
    return out


__all__ = ["GRAMMAR", "Action", "ActionKind", "Run", "directions", "format_actions",
           "parse_actions", "phases", "runs"]
