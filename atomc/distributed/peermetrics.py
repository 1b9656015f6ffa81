"""Peers, what a peer reports: one JSON line per event in its metrics file (when it has one),
a line in its log per round, and its totals (bytes of its rounds, its local steps' time, its
waits) with the summary at the end."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from atomc.distributed.diloco import RoundInfo
from atomc.distributed.peerconfig import PeerConfig
from atomc.units import format_bytes


class PeerMetrics:
    """The metrics of one peer; `digest()` gives the digest of its weights as they are now."""

    def __init__(self, cfg: PeerConfig, log: Callable[[str], None], digest: Callable[[], str]):
        self.cfg = cfg
        self.log = log
        self.digest = digest
        self.rounds_done: list[dict[str, Any]] = []
        self.totals = {"rounds": 0, "sent_bytes": 0, "received_bytes": 0, "compute_s": 0.0,
                       "others_wait_s": 0.0, "round_wait_s": 0.0}

    def write(self, line: dict[str, Any]) -> None:
        if self.cfg.metrics_path is None:
            return
        line = {"peer": self.cfg.name, "time": time.time(), **line}
        with open(self.cfg.metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def record(self, info: dict[str, Any] | RoundInfo, final: bool = False,
               others_wait_s: float = 0.0) -> None:
        """A round in the metrics and the log: its group, bytes and waits. `info`: a DiLoCo
        round's RoundInfo, or a round of the weights (ATOM's averaging, final rounds) as a
        dict of members, seconds and bytes."""
        overlapped = False
        if isinstance(info, RoundInfo):
            members = info.members
            overlapped = self.cfg.outer.fragments > 1
            line = {"epoch": info.epoch, "fragment": info.fragment,
                    "sent_bytes": info.sent_bytes, "received_bytes": info.received_bytes,
                    "group_wait_s": info.group_wait_s, "allreduce_s": info.allreduce_s,
                    "seconds": info.exposed_s, "weight": info.weight,
                    "round_dtype": self.cfg.outer.round_dtype or "master"}
        else:
            members = info["members"]
            line = {**{k: v for k, v in info.items() if k != "members"}, "round_dtype": "master"}
        line.update({"event": "round", "group": sorted(members), "ok": bool(members),
                     "final": final, "others_wait_s": others_wait_s,
                     "digest": self.digest()})
        self.rounds_done.append(line)
        t = self.totals
        key = "final_" if final else ""
        t[f"{key}rounds"] = t.get(f"{key}rounds", 0) + 1
        t[f"{key}sent_bytes"] = t.get(f"{key}sent_bytes", 0) + line.get("sent_bytes", 0)
        t[f"{key}received_bytes"] = (t.get(f"{key}received_bytes", 0)
                                     + line.get("received_bytes", 0))
        t["round_wait_s"] += line.get("seconds", 0.0)
        t["others_wait_s"] += others_wait_s
        self.write(line)
        what = f"averaged with {', '.join(sorted(members))}" if members else "no group"
        frag = (f", fragment {line['fragment'] + 1}/{self.cfg.outer.fragments}"
                if overlapped else "")
        if overlapped:
            took = (f"ran beside the local steps, then {line['seconds']:.1f} s more at the "
                    f"boundary")
        else:
            took = ", ".join(x for x in (
                f"waited {others_wait_s:.1f} s for the others" if others_wait_s >= 0.05 else "",
                f"{line['group_wait_s']:.1f} s for the group" if line.get("group_wait_s") else "",
                f"{line.get('seconds', 0.0):.1f} s in all") if x)
        self.log(f"{'final ' if final else ''}round {line['epoch']}{frag}: {what} "
                 f"({line['round_dtype']}): sent {format_bytes(line.get('sent_bytes', 0))}, "
                 f"received {format_bytes(line.get('received_bytes', 0))}; {took}")

    def done(self, wall_s: float, epoch: int, how: str) -> None:
        """The summary at the end: in the log, and as the metrics' "done" line."""
        t = self.totals
        summary = {**t, "wall_s": wall_s,
                   "compute_utilization": t["compute_s"] / wall_s if wall_s else 0.0,
                   "bytes_per_round": t["sent_bytes"] / t["rounds"] if t["rounds"] else 0}
        self.log(f"done: {t['rounds']} rounds, sent {format_bytes(t['sent_bytes'])} "
                 f"({format_bytes(summary['bytes_per_round'])} a round), received "
                 f"{format_bytes(t['received_bytes'])}; final rounds sent "
                 f"{format_bytes(t.get('final_sent_bytes', 0))}; local steps "
                 f"{summary['compute_utilization']:.0%} of {wall_s:.0f} s; waited "
                 f"{t['others_wait_s']:.1f} s for the others and {t['round_wait_s']:.1f} s for "
                 f"rounds")
        self.write({"event": "done", "epoch": epoch, "digest": self.digest(), "how": how,
                    **summary})


__all__ = ["PeerMetrics"]
