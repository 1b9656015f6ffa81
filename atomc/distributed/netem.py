"""Emulated network for the layout benchmark: a Network -> Linux network namespaces on this machine.

input:  a Network (devices, delay ms, bandwidth Gbit/s), optionally a rate scale
output: one network namespace per device, each with a veth pair into a bridge in the root
        namespace and an address 10.231.N.k; per-link rate shaped with `tc` at the sender
        (htb: one class per destination, a u32 filter on the destination address); per-link
        delay with `tc netem` where the kernel has it, otherwise reported as `send-path`: the
        layout runner then adds each link's delay to its own sends (`--emulate-delay`)

Needs root (CAP_NET_ADMIN), `ip` and `tc`. `available()` says why not when it cannot work, so
callers can skip cleanly. Everything created carries a per-process prefix and is removed by
`down()` (also at interpreter exit and on SIGTERM/SIGINT).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Any

from atomc.errors import NetworkError


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise NetworkError(f"`{' '.join(cmd)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def available() -> tuple[bool, str]:
    """(True, "") when namespaces, veth, bridges and tc can be used here; else (False, why)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root (CAP_NET_ADMIN); run the benchmark as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"atcprobe{os.getpid() % 100000}"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return False, f"cannot create a network namespace: {r.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return True, ""


def _rate(gbps: float) -> str:
    kbit = max(round(gbps * 1e6), 8)
    return f"{kbit}kbit"


@dataclass
class EmulatedNetwork:
    """Namespaces for the devices of `network` (see the module docstring)."""

    network: Any  # atomc.place.network.Network
    rate_scale: float = 1.0  # multiply every bandwidth (to make small models network-bound)
    subnet: int = 231  # 10.<subnet>.<n>.<k>
    prefix: str = ""
    delay_mode: str = ""  # "netem" or "send-path", set by up()
    names: list[str] = field(default_factory=list)
    _up: bool = False

    def __post_init__(self) -> None:
        if not self.prefix:
            self.prefix = f"atc{os.getpid() % 10000}"
        self.n = len(self.network.devices)
        if self.n > 250:
            raise NetworkError(f"{self.n} devices do not fit one /24; emulate at most 250")

    # ---- names ---------------------------------------------------------------------------------

    def ns(self, k: int) -> str:
        return f"{self.prefix}n{k}"

    def iface(self, k: int) -> str:
        return f"{self.prefix}p{k}"  # inside namespace k

    def addr(self, k: int) -> str:
        return f"10.{self.subnet}.0.{k + 1}"

    def exec_prefix(self, k: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(k)]

    # ---- life cycle ----------------------------------------------------------------------------

    def up(self) -> EmulatedNetwork:
        ok, why = available()
        if not ok:
            raise NetworkError(why)
        atexit.register(self.down)
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)

            def handler(signum, frame, previous=previous):
                self.down()
                if callable(previous):
                    previous(signum, frame)
                raise SystemExit(128 + signum)

            signal.signal(sig, handler)
        self._up = True
        br = f"{self.prefix}br"
        _run(["ip", "link", "add", br, "type", "bridge"])
        _run(["ip", "link", "set", br, "up"])
        for k in range(self.n):
            ns, inside, outside = self.ns(k), self.iface(k), f"{self.prefix}v{k}"
            _run(["ip", "netns", "add", ns])
            self.names.append(ns)
            _run(["ip", "link", "add", outside, "type", "veth", "peer", "name", inside])
            _run(["ip", "link", "set", inside, "netns", ns])
            _run(["ip", "link", "set", outside, "master", br])
            _run(["ip", "link", "set", outside, "up"])
            x = self.exec_prefix(k)
            _run(x + ["ip", "addr", "add", f"{self.addr(k)}/24", "dev", inside])
            _run(x + ["ip", "link", "set", inside, "up"])
            _run(x + ["ip", "link", "set", "lo", "up"])
            # packets of at most one MTU: otherwise the kernel hands a whole message to the
            # qdisc as one segmentation-offload packet of up to 64 KiB, and htb lets it
            # through at once while its bucket is not in debt, so a message on an idle link
            # arrives without its bytes / bandwidth on the wire (only the next one pays)
            _run(x + ["ip", "link", "set", "dev", inside, "gso_max_size", "1500"])
        self.delay_mode = "netem"
        for k in range(self.n):
            self._shape(k)
        return self

    def _shape(self, k: int) -> None:
        x = self.exec_prefix(k)
        dev = self.iface(k)
        _run(x + ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
        _run(x + ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                  "rate", "10gbit"])
        for m in range(self.n):
            if m == k:
                continue
            gbps = float(self.network.bandwidth_gbps[k][m]) * self.rate_scale
            cls = f"1:{10 + m}"
            _run(x + ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb",
                      "rate", _rate(gbps), "ceil", _rate(gbps)])
            _run(x + ["tc", "filter", "add", "dev", dev, "protocol", "ip", "parent", "1:0",
                      "prio", "1", "u32", "match", "ip", "dst", f"{self.addr(m)}/32",
                      "flowid", cls])
            delay = float(self.network.delay_ms[k][m])
            if self.delay_mode == "netem" and delay > 0:
                r = _run(x + ["tc", "qdisc", "add", "dev", dev, "parent", cls,
                              "handle", f"{10 + m}:", "netem", "delay", f"{delay:g}ms"],
                         check=False)
                if r.returncode != 0:
                    self.delay_mode = "send-path"  # this kernel has no sch_netem

    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        for ns in self.names:
            _run(["ip", "netns", "del", ns], check=False)  # takes its veth end (and the peer) along
        for k in range(self.n):
            _run(["ip", "link", "del", f"{self.prefix}v{k}"], check=False)
        _run(["ip", "link", "del", f"{self.prefix}br"], check=False)
        self.names = []

    def __enter__(self) -> EmulatedNetwork:  # noqa: PYI034
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def describe(self) -> str:
        head = (f"{self.n} namespaces ({self.prefix}n0..), bridge {self.prefix}br; "
                f"rates x{self.rate_scale:g} by tc htb; delays by {self.delay_mode}")
        lines = [head]
        names = [d.name for d in self.network.devices]
        for k in range(self.n):
            lines.append(f"  {names[k]:<14} {self.ns(k)}  {self.addr(k)}")
        return "\n".join(lines)
