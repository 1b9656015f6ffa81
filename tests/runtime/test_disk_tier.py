"""The disk tier (atomc.runtime.disk, atomc.runtime.tier): model states in files on NVMe drives.

- The files: striped records written aside and switched, read back, linked into a checkpoint
  and adopted again; a killed run's files removed at the next start; each bad offload
  directory refused in one line.
- Streaming: a sub-model's states read, updated and written a segment at a time give the
  masters, moments and images the host store gives, bit for bit (segments cut inside weights,
  the alignment's shared bytes carried).
- Training: with a host cap below the states (the plan puts moments, masters and images on
  disk), SwapTrainer equals plain AdamW in float64 (mini GPT with its tied output layer, a
  tiny Llama; C = 1 and 3); with bfloat16 moments it equals the same run on the host; a
  checkpoint's states on disk resume bit for bit; a run killed while writing its states
  resumes from its checkpoint as if never killed.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atomc.codegen import generate
from atomc.codegen.manual import plan_from_cuts
from atomc.errors import UsageError
from atomc.ir import DiskSpec
from atomc.partition import hostmem
from atomc.partition.hostmem import plan_host_memory
from atomc.runtime import SwapTrainer
from atomc.runtime import tier as tier_module
from atomc.runtime.disk import STRIPE, StateFiles, aligned_buffer, check_dirs
from atomc.trace import trace_model

from helpers.plain import plain_run
from processes import SERIAL, child_env, kill_tree

REPO = Path(__file__).resolve().parents[2]
GPT = REPO / "examples" / "gpt.py"
HF = REPO / "examples" / "hf.py"
MICRO = 2
MODELS = {"mini-gpt": (GPT, "mini", 64, 256), "tiny-llama": (HF, "tiny-llama", 16, 128)}


@pytest.fixture
def small_segments(monkeypatch):
    """Chunks of 4096 weights and segments of 8192: a small model streams in many segments,
    cut inside its weights."""
    monkeypatch.setattr(hostmem, "UPDATE_CHUNK", 4096)
    monkeypatch.setattr(tier_module, "SEGMENT", 1 << 13)
    monkeypatch.setattr(hostmem, "DISK_SEGMENT", 1 << 13)


# ---------------------------------------------------------------------------------------------
# the files


def test_records_are_written_aside_read_back_linked_and_adopted(tmp_path):
    drives = [tmp_path / "a", tmp_path / "b"]
    for d in drives:
        d.mkdir()
    size = 3 * STRIPE + 8192
    files = StateFiles(check_dirs(drives, 1 << 30), [size, 4096])
    try:
        first = aligned_buffer(size)
        first.copy_(torch.randint(0, 255, (first.numel(),), dtype=torch.uint8))
        files.write(0, first).result()
        back = aligned_buffer(size)
        files.read(0, back).result()
        assert torch.equal(back, first)
        # striped: both drives hold part of the record
        assert all(any(run.iterdir()) for run in files.runs)
        links = files.link(tmp_path / "ckpt")
        second = aligned_buffer(size)
        second.fill_(7)
        files.write(0, second).result()
        files.read(0, back).result()
        assert torch.equal(back, second)
        files.adopt(0, links[0])  # the checkpoint's state, untouched by the later write
        files.read(0, back).result()
        assert torch.equal(back, first)
        part = aligned_buffer(8192)
        files.read(0, part, offset=STRIPE, length=8192).result()
        assert torch.equal(part, first[STRIPE:STRIPE + 8192])
        runs = list(files.runs)
    finally:
        files.close()
    assert not any(run.exists() for run in runs)  # the run's files go with it
    assert all(Path(p).is_file() for p in links[0])  # the checkpoint's stay


def test_a_killed_runs_files_are_removed_at_the_next_start(tmp_path):
    stale = tmp_path / f"atomc-run-{2 ** 22 + 12345}-0"  # a process number no process has
    stale.mkdir()
    (stale / "sub0000.g3").write_bytes(b"x" * 4096)
    check_dirs([tmp_path], 0)
    assert not stale.exists()


def test_bad_offload_directories_are_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"does not exist; create it"):
        check_dirs([tmp_path / "none"], 0)
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        check_dirs([tmp_path / "f"], 0)
    with pytest.raises(UsageError, match="is not writable"):
        check_dirs(["/proc"], 0)
    with pytest.raises(UsageError, match=r"free, the run needs .* over 1 drive"):
        check_dirs([tmp_path], 1 << 60)
    with pytest.raises(UsageError, match="no offload directory"):
        check_dirs([], 0)


def test_a_file_system_without_direct_io_goes_through_the_page_cache(tmp_path, monkeypatch):
    # A file system that refuses O_DIRECT (tmpfs on most kernels, some network file systems)
    # answers EINVAL at open; whether this machine's tmpfs does is the kernel's choice.
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    [check] = check_dirs([tmp_path], 0)
    assert not check.direct
    files = StateFiles([check], [8192])
    buf = aligned_buffer(8192)
    buf.fill_(3)
    files.write(0, buf).result()
    back = aligned_buffer(8192)
    files.read(0, back).result()
    assert torch.equal(back, buf) and not files.direct
    files.close()


# ---------------------------------------------------------------------------------------------
# streaming


def _store_and_update(tmp_path, transfer, states, kinds, steps=3):
    from atomc.runtime.cpuoptimizer import CpuOptimizer
    from atomc.runtime.layouts import ParamEntry, SubLayout
    from atomc.runtime.optim import AdamWConfig
    from atomc.runtime.store import HostStore
    from atomc.runtime.trace import Tracer

    sizes = [3000, 7001, 2500, 4096 * 3 + 5]  # offsets that no alignment matches
    entries, off = [], 0
    for k, n in enumerate(sizes):
        entries.append(ParamEntry(f"w{k}", f"w{k}", (n,), n, off, 0, off, k != 2, True, n,
                                  False, True, off))
        off += n
    layout = SubLayout(0, tuple(entries), off, off, off - 2500, off, off)
    drives = check_dirs([tmp_path], 1 << 30) if kinds else ()
    moment = torch.float32 if states == "float32" else torch.bfloat16
    store = HostStore([layout], torch.float32, transfer, pin=False, moment_dtype=moment,
                      disk_kinds=[kinds], drives=drives)
    g = torch.Generator().manual_seed(0)
    store.write_master(0, torch.randn(layout.owned_numel, generator=g))
    opt = CpuOptimizer(store, AdamWConfig(lr=1e-2, states=states), None,
                       Tracer(torch.device("cpu"), enabled=False), threaded=False)
    for step in range(steps):
        store.grads.acquire(0, lambda held: None).copy_(
            torch.randn(layout.grad_numel, generator=g).to(transfer))
        opt.update_now(0, step)
    image = store.load_source(0, (), lambda j: True).clone()
    moments = [None, None]

    def read_moments(a: int, b: int) -> None:
        for m in range(2):
            if moments[m] is None:
                moments[m] = torch.empty(layout.trainable_numel, dtype=moment)
            moments[m][a:min(b, layout.trainable_numel)] = store.moment_part(
                0, m, a, min(b, layout.trainable_numel))

    store.visit(0, 0, layout.trainable_numel, read_moments)
    out = (store.read_master(0).clone(), image, moments)
    segments = len(store.tier.segments[0]) if store.tier is not None else 1
    store.close()
    return out, segments


@pytest.mark.parametrize("transfer, states", [(torch.float32, "float32"),
                                              (torch.bfloat16, "bfloat16"),
                                              (torch.bfloat16, "float32")],
                         ids=["direct", "split-bf16-moments", "split"])
def test_streamed_segments_update_as_the_host_store_does(tmp_path, small_segments, transfer,
                                                         states):
    host, _ = _store_and_update(tmp_path, transfer, states, frozenset())
    disk, segments = _store_and_update(tmp_path, transfer, states,
                                       frozenset({"moments", "masters", "images"}))
    assert segments > 2
    for a, b in zip(host[:2], disk[:2]):
        assert torch.equal(a, b)
    for a, b in zip(host[2], disk[2]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# training


@functools.cache
def _traced(name: str):
    """The model traced once for this module's packages (each cuts it the same way)."""
    path, config, _, _ = MODELS[name]
    return trace_model(path, config, MICRO, device="cpu")


def _package(tmp_path, name: str, accum: int, states: str = "float32", disk: bool = True,
             transfer: str = ""):
    """A package of the model cut in four, planned for a host cap nothing fits under with one
    drive: every state on disk but a tied output layer's holder's image (it stays on the
    host); `disk` False: the same cuts planned for a host that holds everything;
    `transfer`: the plan's transfer dtype (bfloat16: a split store)."""
    _, _, seq, vocab = MODELS[name]
    traced = _traced(name)
    n = len(traced.graph.nodes)
    first = 1 + max(i for i, node in enumerate(traced.graph.nodes) if node.op == "placeholder")
    plan = plan_from_cuts(traced, [first + (n - first) * k // 4 for k in range(1, 4)], accum)
    plan = dataclasses.replace(plan, transfer_dtype=transfer or plan.transfer_dtype)
    host = plan_host_memory(plan, traced.graph, states, 1 if disk else 0, "a test's cap",
                            disk=DiskSpec(1, 1.0, 1.0))
    assert any("moments" in k and "masters" in k for k in host.disk_kinds) == disk
    out = generate(dataclasses.replace(plan, host=host),
                   tmp_path / f"{name}-{accum}-{'disk' if disk else 'host'}", traced=traced)
    return out, traced, seq, vocab, host


def _batches(accum: int, seq: int, vocab: int, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (accum * MICRO, seq), generator=g) for _ in range(steps)]


def _model(traced, dtype=torch.float64):
    torch.manual_seed(0)
    return traced.module.build_model(traced.graph.config).to(dtype)


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_states_on_disk_train_as_plain_adamw_in_float64(tmp_path, small_segments, name, accum):
    pkg, traced, seq, vocab, host = _package(tmp_path, name, accum)
    model = _model(traced)
    offload = tmp_path / "nvme"
    offload.mkdir()
    trainer = SwapTrainer.from_package(pkg, device="cpu", state_dict=model.state_dict(),
                                       offload_dirs=(str(offload),), optimizer={"lr": 1e-2})
    assert trainer.store.disk_kinds == [frozenset(k) for k in host.disk_kinds]
    batches = _batches(accum, seq, vocab)
    losses = [trainer.step(b) for b in batches]
    plain = plain_run(model, traced.module.loss_fn, batches, accum)
    assert losses == pytest.approx(plain, rel=0, abs=1e-12)
    state, ref = trainer.export_state_dict(), model.state_dict()
    for k, v in ref.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-12, msg=k)
    files = trainer.store.tier.files
    assert files.bytes_written > 3 * sum(files.sizes)  # every step wrote every record
    trainer.close()
    assert not any(offload.iterdir())


@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_moments_on_disk_train_as_on_the_host(tmp_path, small_segments, name):
    pkg, traced, seq, vocab, _ = _package(tmp_path, name, 3, "bfloat16")
    model = _model(traced)
    (tmp_path / "nvme").mkdir()
    options = {"device": "cpu", "state_dict": model.state_dict(),
               "optimizer": {"lr": 1e-2, "states": "bfloat16"}}
    disk = SwapTrainer.from_package(pkg, offload_dirs=(str(tmp_path / "nvme"),), **options)
    # the same cuts, every state on the host
    on_host, *_ = _package(tmp_path, name, 3, "bfloat16", disk=False)
    host = SwapTrainer.from_package(on_host, **options)
    assert any(disk.store.disk_kinds) and not any(host.store.disk_kinds)
    batches = _batches(3, seq, vocab)
    assert [disk.step(b) for b in batches] == [host.step(b) for b in batches]
    a, b = disk.export_state_dict(), host.export_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    disk.close()
    host.close()


@pytest.mark.parametrize("transfer", ["", "bfloat16"], ids=["float64", "split"])
def test_a_checkpoint_with_states_on_disk_resumes_bit_for_bit(tmp_path, small_segments,
                                                              transfer):
    # the tied output layer's holder keeps its image on the host: in a checkpoint beside
    # its record (float64: the master itself; split: the master's high half)
    pkg, traced, seq, vocab, _ = _package(tmp_path, "mini-gpt", 3, transfer=transfer)
    model = _model(traced, torch.float32 if transfer else torch.float64)
    offload = tmp_path / "nvme"
    offload.mkdir()
    options = {"device": "cpu", "offload_dirs": (str(offload),), "optimizer": {"lr": 1e-2}}
    batches = _batches(3, seq, vocab, steps=4)
    a = SwapTrainer.from_package(pkg, state_dict=model.state_dict(), **options)
    for b in batches[:2]:
        a.step(b)
    ckpt = tmp_path / "run.pt"
    a.save_checkpoint(ckpt)
    later = [a.step(b) for b in batches[2:]]
    final = a.export_state_dict()
    a.close()
    # the checkpoint's states stayed, linked beside the run's (now gone) folder
    linked = [p for p in offload.rglob("sub*") if p.is_file()]
    assert linked and all("run.pt.states" in str(p) for p in linked)
    b = SwapTrainer.from_package(pkg, checkpoint=ckpt, **options)
    assert b.step_count == 2
    assert [b.step(x) for x in batches[2:]] == later
    again = b.export_state_dict()
    assert all(torch.equal(again[k], final[k]) for k in final)
    b.close()


KILLED = '''
import os, signal, sys, torch
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from atomc.partition import hostmem
from atomc.runtime import SwapTrainer, tier
from atomc.runtime.disk import RecordWriter
hostmem.UPDATE_CHUNK = 4096  # small_segments's
tier.SEGMENT = hostmem.DISK_SEGMENT = 1 << 13
pkg, offload, ckpt = sys.argv[1:4]
model = torch.load(Path(ckpt).with_suffix(".init"), weights_only=True)
batches = torch.load(Path(ckpt).with_suffix(".batches"), weights_only=True)
t = SwapTrainer.from_package(pkg, device="cpu", state_dict=model, offload_dirs=(offload,),
                             optimizer={"lr": 1e-2})
for b in batches[:2]:
    t.step(b)
t.save_checkpoint(ckpt)
print("checkpointed", flush=True)
puts = [0]
original = RecordWriter.put
def put(self, offset, data, done=None):
    puts[0] += 1
    if puts[0] == 7:  # in the middle of the next step's writes of the states
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, offset, data, done)
RecordWriter.put = put
t.step(batches[2])
print("not killed", flush=True)
'''


@SERIAL
def test_a_run_killed_while_writing_its_states_resumes_from_its_checkpoint(tmp_path,
                                                                           small_segments):
    pkg, traced, seq, vocab, _ = _package(tmp_path, "mini-gpt", 1)
    model = _model(traced)
    offload = tmp_path / "nvme"
    offload.mkdir()
    ckpt = tmp_path / "run.pt"
    batches = _batches(1, seq, vocab, steps=4)
    torch.save(model.state_dict(), ckpt.with_suffix(".init"))
    torch.save(batches, ckpt.with_suffix(".batches"))
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(pkg), str(offload), str(ckpt),
                             str(REPO / "tests")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    assert "checkpointed" in out and "not killed" not in out
    assert any(offload.glob("atomc-run-*"))  # the killed run's files, left behind
    # the uninterrupted run, here on one thread as the child ran (float64 sums are rounded
    # in the order the threads split them)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        options = {"device": "cpu", "offload_dirs": (str(offload),), "optimizer": {"lr": 1e-2}}
        whole = SwapTrainer.from_package(pkg, state_dict=model.state_dict(), **options)
        assert not any(p.name.startswith(f"atomc-run-{proc.pid}-") for p in offload.iterdir())
        expected = [whole.step(b) for b in batches]
        final = whole.export_state_dict()
        whole.close()
        resumed = SwapTrainer.from_package(pkg, checkpoint=ckpt, **options)
        assert [resumed.step(b) for b in batches[2:]] == expected[2:]
        state = resumed.export_state_dict()
        assert [k for k in final if not torch.equal(state[k], final[k])] == []
        resumed.close()
    finally:
        torch.set_num_threads(threads)


def test_a_plan_with_states_on_disk_asks_for_the_drives_in_one_line(tmp_path):
    pkg, traced, *_ = _package(tmp_path, "mini-gpt", 1)
    with pytest.raises(UsageError, match=r"model states on disk .* give --offload-dir PATH"):
        SwapTrainer.from_package(pkg, device="cpu", state_dict=_model(traced).state_dict())
    with pytest.raises(UsageError, match="does not exist"):
        SwapTrainer.from_package(pkg, device="cpu", state_dict=_model(traced).state_dict(),
                                 offload_dirs=(str(tmp_path / "missing"),))


def test_the_plan_moves_moments_then_masters_then_images_largest_first():
    from atomc.partition.hostmem import (
        SubmodelWeights,
        host_bytes_by_kind,
        place_on_disk,
        segment_bytes,
        states_by_kind,
    )

    n = 1 << 26  # elements: records larger than a segment
    subs = [SubmodelWeights(n, n, n, n), SubmodelWeights(2 * n, 2 * n, 2 * n, 2 * n),
            SubmodelWeights(n + 10, n, n, n + 10, replicas=10)]
    args = ("float32", "bfloat16", "float32")
    whole = sum(host_bytes_by_kind(subs, *args).values())
    moments = 8 * 2 * n  # the largest sub-model's two float32 moments
    assert place_on_disk(subs, *args, whole) == [frozenset()] * 3
    one = place_on_disk(subs, *args, whole - moments // 2)
    assert one == [frozenset(), frozenset({"moments"}), frozenset()]
    every = place_on_disk(subs, *args, 0)
    assert every is None
    most = place_on_disk(subs, *args, 2100 << 20)  # what only every movable state on disk fits
    assert most is not None and "images" not in most[2]  # a replica holder keeps its image
    assert all("moments" in k for k in most)
    # staging is a segment of the record, not the record
    st = states_by_kind(subs[1], *args)
    assert segment_bytes(subs[1], st, {"moments", "masters", "images"}) < sum(st.values()) / 3


def test_atomc_train_and_export_take_the_offload_drives(tmp_path, small_segments, capsys):
    from atomc.cli import main

    pkg, *_ = _package(tmp_path, "mini-gpt", 1, transfer="bfloat16")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ckpt = tmp_path / "run.pt"
    train = ["train", str(pkg), "--steps", "2", "--device", "cpu", "--checkpoint", str(ckpt)]
    assert main(train) == 2
    err = capsys.readouterr().err
    assert "give --offload-dir PATH" in err and len(err.strip().splitlines()) == 1
    assert main([*train, "--offload-dir", str(nvme)]) == 0
    assert "writing" in capsys.readouterr().err  # the first write of the states, with progress
    assert [p.name for p in nvme.iterdir()] == ["run.pt.states"]  # the checkpoint's, only
    out = tmp_path / "export"
    assert main(["export", str(pkg), "--checkpoint", str(ckpt), "-o", str(out),
                 "--offload-dir", str(nvme)]) == 0
    assert any(out.glob("*.safetensors"))


def test_diloco_s_outer_state_goes_to_the_drives_that_hold_the_masters(tmp_path, small_segments):
    """A peer's outer state (start weights and momentum: one or two copies of the masters)
    follows the masters: on the offload drives where the plan put them there, one record a
    fragment; in host memory otherwise."""
    from atomc.distributed.diloco import OuterRounds, read_fragment
    from atomc.distributed.outer import (
        DiskOuterOptimizer,
        OuterConfig,
        OuterOptimizer,
        fragments_of,
    )

    cfg = OuterConfig.make("nesterov", inner_steps=4, fragments=2)
    for disk in (True, False):
        pkg, traced, *_ = _package(tmp_path, "mini-gpt", 1, disk=disk)
        offload = tmp_path / f"nvme-{disk}"
        offload.mkdir()
        trainer = SwapTrainer.from_package(pkg, device="cpu",
                                           state_dict=_model(traced).state_dict(),
                                           offload_dirs=(str(offload),) if disk else (),
                                           optimizer={"lr": 1e-2})
        try:
            frags = fragments_of([L.owned_numel for L in trainer.store.layouts], 2)
            runs_before = {p.name for p in offload.glob("atomc-run-*")}
            rounds = OuterRounds(trainer, cfg, frags, name="me", log=lambda s: None)
            try:
                assert isinstance(rounds.outer, DiskOuterOptimizer if disk else OuterOptimizer)
                if disk:
                    masters = (sum(L.owned_numel for L in trainer.store.layouts)
                               * trainer.store.master_dtype.itemsize)
                    assert rounds.outer.disk_bytes >= 2 * masters
                    assert {p.name for p in offload.glob("atomc-run-*")} > runs_before
                for f, fr in enumerate(frags):  # the round's start: the masters as they are
                    now = read_fragment(trainer, fr)
                    assert not rounds.outer.pseudo_gradient(f, now).any()
            finally:
                rounds.close()
            assert {p.name for p in offload.glob("atomc-run-*")} == runs_before
        finally:
            trainer.close()
