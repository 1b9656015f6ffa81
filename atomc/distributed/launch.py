"""Layout runner, launch: a layout -> the torchrun command that starts its D_PP x D_DP processes.

input:  a layout file, the training script and its arguments, where the rendezvous runs, how
        many machines take part and how many processes this one starts
output: the command (`python -m torch.distributed.run ...`, i.e. torchrun with this Python) and
        the environment it needs (ATOMC_LAYOUT, and ATOMC_DEVICES when this machine's devices
        are named); `atomc launch` prints it or runs it

Elastic by default: the c10d rendezvous backend and `--max-restarts`, so a worker that dies
takes its job through a restart, and the workers resume from their last checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from atomc.distributed.groups import LayoutView, load_layout
from atomc.errors import LayoutError, UsageError


@dataclass
class LaunchCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the caller's environment

    def text(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + " ".join(shlex.quote(a) for a in self.argv)


def build_command(layout_path: str | Path, script: str, script_args: list[str], *, nnodes: int = 1,
                  nproc_per_node: int | None = None, rdzv_endpoint: str = "127.0.0.1:29400",
                  rdzv_id: str | None = None, max_restarts: int = 3,
                  monitor_interval_s: float = 0.5,
                  devices: list[str] | None = None, network: str | Path | None = None,
                  python: str | None = None, layout: LayoutView | None = None) -> LaunchCommand:
    view = layout or load_layout(layout_path)
    world = view.world_size
    if nnodes < 1:
        raise UsageError(f"--nnodes {nnodes} must be at least 1")
    if nproc_per_node is None:
        if world % nnodes:
            raise LayoutError(f"{view.source} has {world} tasklets, which do not split evenly over "
                              f"{nnodes} machines; give --nproc-per-node for this machine")
        nproc_per_node = world // nnodes
    if nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node {nproc_per_node} must be at least 1")
    if nnodes == 1 and nproc_per_node != world:
        raise LayoutError(f"{view.source} has {view.pp} stages x {view.dp} replicas = {world} "
                          f"tasklets, but --nproc-per-node {nproc_per_node} on one machine starts "
                          f"{nproc_per_node} processes; start {world} (or spread them with "
                          f"--nnodes)")
    if nproc_per_node * nnodes > world:
        raise LayoutError(f"{nnodes} machines x {nproc_per_node} processes exceed the layout's "
                          f"{world} tasklets; start exactly {world} processes in all")
    known = {d for row in view.devices for d in row}
    if devices:
        unknown = [d for d in devices if d not in known]
        if unknown:
            raise LayoutError(f"devices {unknown} are not in {view.source} (its devices: "
                              f"{sorted(known)}); name this machine's devices as the layout does")
        if len(devices) != nproc_per_node:
            raise UsageError(f"--devices names {len(devices)} devices for {nproc_per_node} "
                             f"processes on this machine; name one device per process")
    if ":" not in rdzv_endpoint:
        raise UsageError(f"--rdzv-endpoint {rdzv_endpoint!r}: expected HOST:PORT")
    run_id = rdzv_id or "atomc-" + hashlib.sha256(
        str(Path(layout_path).resolve()).encode()).hexdigest()[:8]
    argv = [python or sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={run_id}",
            f"--max-restarts={max_restarts}", f"--monitor-interval={monitor_interval_s:g}",
            script, *script_args]
    env = {"ATOMC_LAYOUT": str(Path(layout_path)),
           # torch's c10d rendezvous keeps its TCP store across elastic restarts, and the restarted
           # workers' gloo then reads the dead workers' addresses from it ("connectFullMesh ...
           # Connection refused"); with this, rank 0 hosts a fresh store every attempt
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if network is not None:
        env["ATOMC_NETWORK"] = str(Path(network))
    if devices:
        env["ATOMC_DEVICES"] = ",".join(devices)
    host = rdzv_endpoint.rsplit(":", 1)[0]
    if host in ("127.0.0.1", "localhost") and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # one machine: gloo talks over loopback
    return LaunchCommand(argv, env)


def run_command(cmd: LaunchCommand) -> int:
    """Run torchrun in the foreground; its exit status is ours (Ctrl-C reaches every worker)."""
    import subprocess

    env = dict(os.environ)
    env.update(cmd.env)
    try:
        return subprocess.call(cmd.argv, env=env)
    except KeyboardInterrupt:
        return 130
