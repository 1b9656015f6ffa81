"""SWARM, what servers and trainers share in hivemind's DHT (one key per fact, one subkey per peer).

- `{prefix}.servers`: each server's record, refreshed every heartbeat and expiring after
  `expiration_s` (a SIGKILLed server drops out when it stops refreshing): stage, the step its
  stage is at, the samples it holds for that step, throughput, queue, the package it serves.
- `{prefix}.servers`, subkey `{peer}!gone`: a trainer could not connect to that server (its
  latest announcement, and when the report was made); readers drop it a second after the
  report unless it announces again, without waiting for its record to expire.
- `{prefix}.excluded.{step}`: servers a trainer stopped trusting during a step (a call that
  failed or timed out, or a record gone), each with the attempt it was on: the gradients it
  held under that attempt never count. The trainers send those micro-batches again, and the
  server itself, if it is alive after all, drops them and starts its next attempt at the step
  (so a stage's last server, wrongly given up on, is not shut out of the step for good).
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass
from typing import Any

from hivemind.utils import get_dht_time


@dataclass(frozen=True)
class ServerRecord:
    peer: str  # hivemind peer id (base58)
    name: str
    stage: int
    step: int  # optimizer steps its stage has taken (the step it accumulates for)
    samples: int  # samples of `step` whose gradients it holds
    throughput: float  # samples per second it has served (EMA)
    queue: int  # requests waiting or running
    package: str  # the package's fingerprint
    started: float  # when this incarnation started serving its stage (DHT time)
    moving: bool = False  # changing stage: not taking requests
    measured: bool = True  # `throughput` measured on this stage (not a stand-in): movable
    attempt: int = 0  # its gradients of `step` since it last dropped them (records' docstring)
    served: tuple[float, ...] = ()  # its throughput on each stage it left (0: never served)
    announced: float = 0.0  # DHT time of this announcement (a report of it gone names it)

    def to_value(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, peer: str, value: Any) -> ServerRecord | None:
        if not isinstance(value, dict):
            return None
        try:
            rec = cls(**{**value, "peer": peer,
                         "served": tuple(float(x) for x in value.get("served", ()))})
        except (TypeError, ValueError):
            return None  # another version's record: ignored rather than trusted
        rates = (rec.throughput, *rec.served)
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in rates):
            return None  # a rate no plan can use
        return rec


def servers_key(prefix: str) -> str:
    return f"{prefix}.servers"


GONE = "!gone"  # a subkey `{peer}!gone` of the servers key: a trainer could not reach it
GONE_GRACE_S = 1.0  # a report counts if no newer announcement came for this long (2 heartbeats)


def report_gone(dht: Any, prefix: str, record: ServerRecord, ttl_s: float) -> None:
    """A trainer could not connect to `record`'s server: readers drop that announcement
    (and older ones) a grace after the report rather than when it expires; a server that is
    alive after all shows again with its next heartbeat. The report names the announcement
    and when it was made (DHT time): every reader drops the record at the same DHT time, so
    the servers that rebalance see the server gone at the same decision tick (were each reader
    to count the grace from its own first sight of the report, servers of one plan would see
    the event a tick apart, and only some of them would move)."""
    now = float(get_dht_time())
    dht.store(servers_key(prefix), subkey=record.peer + GONE, value=[record.announced, now],
              expiration_time=now + ttl_s, return_future=True)


def _report(value: Any) -> tuple[float, float] | None:
    """(announcement named, DHT time of the report) of a gone report's value, or None."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(x, (int, float)) and math.isfinite(x) for x in value):
        return float(value[0]), float(value[1])
    return None


def excluded_key(prefix: str, step: int) -> str:
    return f"{prefix}.excluded.{step}"


def _read_expiring(dht: Any, key: str) -> dict[str, tuple[Any, float]]:
    """Subkey -> (value, DHT expiration time) of a dictionary key (the latest, unexpired
    entries)."""
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    out = {}
    for sub, item in found.value.items():
        value = getattr(item, "value", None)
        if value is not None:
            out[str(sub)] = (value, float(item.expiration_time))
    return out


def read_dict(dht: Any, key: str) -> dict[str, Any]:
    """Subkey -> value of a dictionary key (the latest, unexpired entries)."""
    return {sub: value for sub, (value, _) in _read_expiring(dht, key).items()}


def read_servers(dht: Any, prefix: str) -> list[ServerRecord]:
    return Roster(dht, prefix).read()


class Roster:
    """The servers as successive DHT reads see them. A record counts until its own expiration
    time, even when a later read misses it: a read asks a few DHT nodes, and right after a
    peer dies one of them may answer without a record that is still live. Waiting for the
    record's expiration, rather than a fixed grace after the first miss, is safe; a SIGKILLed
    server drops out when its last refresh expires, or sooner when a trainer reports it gone
    (`report_gone`): a report counts `gone_grace_s` after it was made (DHT time) if no newer
    announcement of that server came, so that a live server that one call failed to reach,
    and which announces every heartbeat, is never hidden."""

    def __init__(self, dht: Any, prefix: str, gone_grace_s: float = GONE_GRACE_S):
        self.dht, self.prefix = dht, prefix
        self.gone_grace_s = gone_grace_s
        # a trainer reads from executor threads that can overlap (its routes' refresh, its
        # commit wait): one read at a time, or a dict changes size while another walks it
        self.lock = threading.RLock()
        self.seen: dict[str, tuple[ServerRecord, float]] = {}  # peer -> record, expiration
        # peer -> (the announcement a report named, the report's DHT time, its expiration)
        self.reports: dict[str, tuple[float, float, float]] = {}

    def read(self) -> list[ServerRecord]:
        with self.lock:
            return self._read()

    def _read(self) -> list[ServerRecord]:
        for sub, (value, expires) in _read_expiring(self.dht, servers_key(self.prefix)).items():
            if sub.endswith(GONE):
                peer = sub[:-len(GONE)]
                report = _report(value)
                if report is not None and report[0] > self.reports.get(peer, (-math.inf,))[0]:
                    self.reports[peer] = (*report, expires)
                continue
            rec = ServerRecord.from_value(sub, value)
            if rec is not None and rec.announced >= self.announced(sub):
                self.seen[sub] = (rec, expires)
        now = get_dht_time()
        self.reports = {p: r for p, r in self.reports.items() if r[2] > now}
        self.seen = {p: (r, e) for p, (r, e) in self.seen.items()
                     if e > now and not self._reported(p, r, now)}
        return sorted((r for r, _ in self.seen.values()), key=lambda r: (r.stage, r.peer))

    def _reported(self, peer: str, rec: ServerRecord, now: float) -> bool:
        # a grace after the report, the same moment for every reader (see report_gone)
        named, at, _ = self.reports.get(peer, (-math.inf, math.inf, 0.0))
        return rec.announced <= named and now - at >= self.gone_grace_s

    def record(self, peer: str) -> ServerRecord | None:
        with self.lock:
            held = self.seen.get(peer)
        return held[0] if held is not None else None

    def announced(self, peer: str) -> float:
        """When the latest announcement of `peer` that this roster holds was made."""
        rec = self.record(peer)
        return rec.announced if rec is not None else -math.inf


def excluded_subkey(peer: str, stage: int, attempt: int) -> str:
    return f"{peer}@{stage}#{attempt}"


def read_excluded(dht: Any, prefix: str, step: int) -> set[tuple[str, int, int]]:
    """(peer, stage, attempt) excluded from `step`: a server that moves on to another stage is
    trusted there, and on its next attempt at the step."""
    out = set()
    for sub in read_dict(dht, excluded_key(prefix, step)):
        peer, _, rest = sub.rpartition("@")
        stage, _, attempt = rest.partition("#")
        if peer and stage.isdigit() and attempt.isdigit():
            out.add((peer, int(stage), int(attempt)))
    return out
