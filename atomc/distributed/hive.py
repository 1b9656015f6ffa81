"""The hivemind plumbing that peers (atomc.distributed.peer) and SWARM (atomc.swarm) share:
importing hivemind with an error that says how to install it and its log in one line per
record, a DHT node started with every wait bounded, and a training state as one byte tensor for
hivemind's p2p messages.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from atomc.errors import PeerError


def import_hivemind() -> Any:
    try:
        import hivemind
    except ImportError as e:  # pragma: no cover - installed with atomc's peers extra
        raise PeerError(f"hivemind is not installed ({e}); install it from its wheel: "
                        f"pip install --only-binary=hivemind hivemind") from None
    if os.environ.get("HIVEMIND_LOGLEVEL", "").upper() != "DEBUG":
        for handler in logging.getLogger("hivemind").handlers:
            if not any(isinstance(f, _OneLine) for f in handler.filters):
                handler.addFilter(_OneLine())
    return hivemind


class _OneLine(logging.Filter):
    """hivemind logs a failure it recovers from with its traceback (a state download cut short
    by a peer that left, tried again with the next peer). The record's message already names
    the exception, so the user reads one line; HIVEMIND_LOGLEVEL=DEBUG keeps the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return True


def state_bytes(state: dict[str, Any]) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def state_from_bytes(t: torch.Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(t.numpy().tobytes()), map_location="cpu", weights_only=True)


def start_dht(hm: Any, initial_peers: Sequence[str], host_maddrs: Sequence[str],
              announce_maddrs: Sequence[str], timeout_s: float) -> Any:
    """A hivemind DHT node joined through `initial_peers` (none: a new network), with every wait
    bounded: an initial peer that never answers is a PeerError after `timeout_s`."""
    for a in initial_peers:
        if not a.startswith("/"):
            raise PeerError(f"initial peer {a!r} is not a multiaddress; give one another peer "
                            f"printed, e.g. /ip4/127.0.0.1/tcp/PORT/p2p/PEER_ID")
    # loopback-friendly and private: no IPFS bootstrap, no relays, no NAT traversal or UPnP
    kwargs: dict[str, Any] = {
        "initial_peers": list(initial_peers), "host_maddrs": list(host_maddrs),
        "start": True, "use_ipfs": False, "use_relay": False, "use_auto_relay": False,
        "auto_nat": False, "nat_port_map": False, "client_mode": False,
        "startup_timeout": timeout_s}
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    box: dict[str, Any] = {}

    def start() -> None:
        try:
            box["dht"] = hm.DHT(**kwargs)
        except BaseException as e:  # noqa: BLE001 - surfaced below as a PeerError
            box["error"] = e

    th = threading.Thread(target=start, daemon=True)
    th.start()
    th.join(timeout_s + 15.0)
    where = ", ".join(initial_peers) or "(none: first peer)"
    if th.is_alive():
        raise PeerError(f"the peer network did not start within {timeout_s + 15:.0f} s (initial "
                        f"peers {where}); check that they are alive and reachable")
    if "error" in box:
        e = box["error"]
        said = " ".join(str(e).split())[:300]  # p2pd's last line of output, for a daemon error
        if "failed to listen" in said:
            raise PeerError(f"the p2p daemon could not listen on {', '.join(host_maddrs)}: "
                            f"{said}; give --host-maddrs an address of this machine (e.g. "
                            f"/ip4/0.0.0.0/tcp/PORT) and a free port") from None
        if "bootstrap" in said or initial_peers:
            raise PeerError(f"could not join the peers through {where}: {type(e).__name__}: "
                            f"{said}; give the address of a live peer (it prints it at start) "
                            f"and check that its port is reachable") from None
        raise PeerError(f"the p2p daemon failed to start: {type(e).__name__}: {said}") from None
    return box["dht"]


__all__ = ["import_hivemind", "start_dht", "state_bytes", "state_from_bytes"]
