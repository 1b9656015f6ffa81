"""The disk tier against the drive, and a run whose states are 4x its host cap.

    python bench/nvme_bench.py [--dir /tmp] [--gib 2] [--rounds 3] [--steps 4]

1. Rates: the disk tier's own I/O (atomc.runtime.disk.StateFiles: O_DIRECT, 4 MiB stripes,
   several requests in flight, through `atomc.calibrate.disk.measure_drive`) writes, flushes
   and reads back a record of --gib GiB in --dir; `dd` with direct I/O (oflag=direct
   conv=fsync, iflag=direct, 4 MiB blocks) and buffered `dd` (conv=fsync) move the same bytes
   in the same directory in the same run. Medians of --rounds; the ratio of the tier to
   direct `dd` is the figure (goal: 0.8 or more).
2. A run past the host: an MLP of 64 layers of 2048 x 2048 (269M parameters, 3.2 GB of fp32
   masters and moments) cut in 64 sub-models and planned for a host cap of a quarter of its
   states, so the plan puts moments, masters and images on the drive. A fresh process trains
   it on the CPU device from a safetensors checkpoint (the original model is never built),
   and its peak RSS (VmHWM) less its RSS before the trainer is compared with the plan's host
   figure plus what the device holds: on a CPU device the runtime's weight and gradient slots
   and the compute's working memory live in the same RAM (the slots are read off the trainer;
   the working memory is bounded by the sub-model's own activations, small here).
   Samples a second and the bytes the tier moved per step are printed.

fio is not installed on the machines this was written on, and DeepSpeed's async I/O op,
liburing bindings and kvikio do not install without a CUDA toolkit or network access; the
tier's own path is Python threads over os.preadv/os.pwritev.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MLP = '''
import torch
from torch import nn

WIDTH, DEPTH = 2048, 64


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def build_model(config=None):
    return Net()


def example_inputs(model, batch_size):
    return (torch.randn(batch_size, WIDTH),)


def loss_fn(out, batch):
    return out.square().mean()
'''

PARTS = 64  # one layer a sub-model: the staging buffers are a few sub-models' records

PROBE = '''
import json, sys, time
import torch
from atomc.runtime import SwapTrainer


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024


package, weights, drive, steps, batch = sys.argv[1:6]
p = torch.nn.Parameter(torch.zeros(8))
p.grad = torch.zeros(8)
torch.optim.AdamW([p], fused=True).step()  # the fused kernels' first use (~80 MB of code)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the imports' peak: start it again here
before = status("VmRSS")
trainer = SwapTrainer.from_package(package, device="cpu", weights=weights,
                                   offload_dirs=[drive])
slots = trainer.executor.slots
slot_bytes = sum(t.numel() * t.element_size() for t in slots.params + slots.grads)
g = torch.Generator().manual_seed(0)
x = torch.randn(int(batch), 2048, generator=g)
trainer.step((x,))  # the first step writes every record once
files = trainer.store.tier.files if trainer.store.tier is not None else None
read0 = files.bytes_read if files else 0
wrote0 = files.bytes_written if files else 0
t0 = time.perf_counter()
for _ in range(int(steps)):
    trainer.step((x,))
spent = time.perf_counter() - t0
out = {"before": before, "peak": status("VmHWM"), "slots": slot_bytes,
       "host_allocated": trainer.store.host_bytes(), "step_s": spent / int(steps),
       "read_per_step": ((files.bytes_read - read0) / int(steps)) if files else 0,
       "written_per_step": ((files.bytes_written - wrote0) / int(steps)) if files else 0,
       "direct": bool(files.direct) if files else None}
trainer.close()
print(json.dumps(out))
'''


def dd_rate(args: list[str], nbytes: int) -> float:
    """GB/s of one `dd` run, timed here (its own figure rounds to two digits)."""
    t0 = time.perf_counter()
    done = subprocess.run(["dd", *args], capture_output=True, text=True)
    spent = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"dd {' '.join(args)} failed: {done.stderr.strip()}")
    copied = re.search(r"^(\d+) bytes", done.stderr, re.M)
    if copied is None or int(copied.group(1)) != nbytes:
        raise SystemExit(f"dd {' '.join(args)} copied {copied and copied.group(1)} bytes, "
                         f"expected {nbytes}")
    return nbytes / spent / 1e9


def dd_parallel(args: list[str], nbytes: int, ways: int, write: bool) -> float:
    """GB/s of `ways` direct `dd` processes, each on its own quarter of the file at once."""
    blocks = nbytes // (4 << 20) // ways
    cmds = []
    for k in range(ways):
        at = f"seek={k * blocks}" if write else f"skip={k * blocks}"
        extra = ["conv=notrunc,fsync"] if write else []
        cmds.append(["dd", *args, "bs=4M", f"count={blocks}", at, *extra])
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    for c, p in zip(cmds, procs):
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"{' '.join(c)} failed: {err.strip()}")
    return blocks * ways * (4 << 20) / (time.perf_counter() - t0) / 1e9


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rates(directory: Path, gib: int, rounds: int) -> dict:
    from atomc.calibrate.disk import measure_drive

    nbytes = gib << 30
    blocks = nbytes // (4 << 20)
    target = directory / f"nvme-bench-{os.getpid()}.bin"
    tier_read, tier_write, direct = measure_drive(directory, nbytes, rounds)
    dd = {"direct_write": [], "direct_read": [], "buffered_write": [], "buffered_read": [],
          "direct_write_4": [], "direct_read_4": []}
    try:
        for _ in range(rounds):
            dd["direct_write"].append(dd_rate(
                ["if=/dev/zero", f"of={target}", "bs=4M", f"count={blocks}", "oflag=direct",
                 "conv=fsync"], nbytes))
            dd["direct_read"].append(dd_rate(
                [f"if={target}", "of=/dev/null", "bs=4M", "iflag=direct"], nbytes))
            dd["direct_write_4"].append(dd_parallel(
                ["if=/dev/zero", f"of={target}", "oflag=direct"], nbytes, 4, write=True))
            dd["direct_read_4"].append(dd_parallel(
                [f"if={target}", "of=/dev/null", "iflag=direct"], nbytes, 4, write=False))
            dd["buffered_write"].append(dd_rate(
                ["if=/dev/zero", f"of={target}", "bs=4M", f"count={blocks}", "conv=fsync"],
                nbytes))
            drop_cache(target)
            dd["buffered_read"].append(dd_rate([f"if={target}", "of=/dev/null", "bs=4M"],
                                               nbytes))
    finally:
        target.unlink(missing_ok=True)
    out = {k: statistics.median(v) for k, v in dd.items()}
    out.update(tier_read=tier_read, tier_write=tier_write, tier_direct=direct)
    return out


def past_the_host(directory: Path, work: Path, steps: int, batch: int, read_gbps: float,
                  write_gbps: float) -> dict:
    import torch
    from safetensors.torch import save_file

    from atomc.codegen import generate
    from atomc.codegen.manual import plan_from_cuts
    from atomc.ir import DiskSpec
    from atomc.partition.hostmem import plan_host_memory
    from atomc.trace import load_model_file, trace_model

    model_file = work / "mlp.py"
    model_file.write_text(MLP)
    traced = trace_model(model_file, None, batch, device="meta")
    n = len(traced.graph.nodes)
    first = 1 + max(i for i, node in enumerate(traced.graph.nodes) if node.op == "placeholder")
    plan = plan_from_cuts(traced, [first + (n - first) * k // PARTS for k in range(1, PARTS)], 1)
    params = sum(t.numel() for t in load_model_file(model_file).build_model().parameters())
    states = params * 12  # fp32 masters and two fp32 moments
    cap = states // 4
    host = plan_host_memory(plan, traced.graph, "float32", cap, "the bench's cap",
                            disk=DiskSpec(1, read_gbps, write_gbps, 0, "measured above"))
    if host.total() > cap:
        raise SystemExit(f"the plan needs {host.total()} host bytes over the cap {cap}")
    pkg = generate(dataclasses.replace(plan, host=host), work / "pkg", traced=traced)
    torch.manual_seed(0)
    save_file(load_model_file(model_file).build_model().state_dict(), work / "model.safetensors")
    env = dict(os.environ, OMP_NUM_THREADS="2",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", PROBE, str(pkg), str(work / "model.safetensors"),
                           str(directory), str(steps), str(batch)],
                          capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        raise SystemExit(f"the training process failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    got.update(params=params, states=states, cap=cap, plan_host=host.total(),
               plan_by_kind=host.by_kind, disk_by_kind=host.disk_by_kind,
               on_disk=sum(1 for k in host.disk_kinds if k), submodels=len(plan.submodels))
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the drive")
    ap.add_argument("--gib", type=int, default=2, help="record size of the rate test")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="measured steps of the run")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args(argv)
    directory = Path(args.dir)
    r = rates(directory, args.gib, args.rounds)
    gb = 1e9
    print(f"drive {directory} ({'direct I/O' if r['tier_direct'] else 'page cache'}), "
          f"{args.gib} GiB, median of {args.rounds}:")
    for way in ("read", "write"):
        best = max(r[f"direct_{way}"], r[f"direct_{way}_4"])
        print(f"  {way:5s}  tier {r[f'tier_{way}']:.2f} GB/s; dd direct {r[f'direct_{way}']:.2f} "
              f"GB/s, 4 at once {r[f'direct_{way}_4']:.2f} GB/s: tier / best dd "
              f"{r[f'tier_{way}'] / best:.2f}; dd buffered{' + fsync' if way == 'write' else ''} "
              f"{r[f'buffered_{way}']:.2f} GB/s")
    with tempfile.TemporaryDirectory(prefix="atomc-nvme-") as tmp:
        run = past_the_host(directory, Path(tmp), args.steps, args.batch, r["tier_read"],
                            r["tier_write"])
    grown = run["peak"] - run["before"]
    host_part = grown - run["slots"]
    print(f"run: {run['params'] / 1e6:.0f}M parameters, states {run['states'] / gb:.2f} GB, "
          f"host cap {run['cap'] / gb:.2f} GB (a quarter), {run['submodels']} sub-models, "
          f"{run['on_disk']} with states on the drive")
    print(f"  plan: host {run['plan_host'] / gb:.3f} GB {run['plan_by_kind']}, disk "
          f"{run['disk_by_kind']}")
    print(f"  measured: peak RSS grew {grown / gb:.3f} GB; less the device's slots "
          f"({run['slots'] / gb:.3f} GB): {host_part / gb:.3f} GB, "
          f"{host_part / run['plan_host']:.2f} x the plan's host figure; the store allocated "
          f"{run['host_allocated'] / gb:.3f} GB")
    moved = run["read_per_step"] + run["written_per_step"]
    print(f"  step {run['step_s']:.2f} s: {args.batch / run['step_s']:.1f} samples/s, "
          f"{run['read_per_step'] / gb:.2f} GB read and {run['written_per_step'] / gb:.2f} GB "
          f"written per step ({moved / gb / run['step_s']:.2f} GB/s), direct I/O "
          f"{run['direct']}")
    print(json.dumps({"rates": r, "run": run}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
