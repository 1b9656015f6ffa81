"""Runtime, activation policy: the outputs of a sub-model's heavy operators kept on the device or
sent to host memory between its forward and its backward, so that the recomputation in the
backward skips them.

A sub-model whose activations are recomputed runs its forward without an autograd graph and
runs it again, with one, in its backward. The plan gives each such sub-model two byte quotas
per micro-batch (Submodel.kept_bytes, Submodel.sent_bytes). The operators they are spent on
are the heavy ones, those torch's FLOP counter counts (matmuls, convolutions, fused attention):
element-wise work is cheaper to redo than to move. Operators that draw random numbers are
never stored: the recomputation must draw what the forward drew, in the same order.

The first forward of a sub-model lists its heavy operators as this device runs them (which
attention kernel runs depends on the device, so the list is the runtime's, not the profile's),
its first recomputation lists its own (without an autograd graph a forward may pick another
kernel), and of the calls both run alike, the outputs with the most FLOPs per byte fill the
keep quota, then the send quota. From then on every forward of it records those outputs
(`Recorder`, a dispatch mode below autograd) and its recomputation returns them in place of
running the operator (`Replayer`).
Below autograd, the recomputation records the same backward graph as a full one: torch's
selective activation checkpointing works the same way, but keeps its cache on the device.

An output that a later operator of the same forward writes in place is copied before the
write, so the recomputation sees the value the operator returned. Sent outputs go to host
buffers reused every step (one arena, pinned on CUDA, as the boundary stash's) on the offload
stream, and come back on the prefetch stream with the sub-model's stashed boundary values,
before its first backward. CPU: the same copies, synchronous.
"""

from __future__ import annotations

import difflib
import functools
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.flop_counter import flop_registry

from atomc.errors import AtomcError
from atomc.runtime.hostcopies import CopyLanes, HostCopies
from atomc.runtime.pinned import HostArena

aten = torch.ops.aten
_TENSOR = object()  # where a sent output's tree had a tensor

# kernels torch's FLOP counter leaves out whose FLOPs equal a counted one's
_SAME_FLOPS = {aten._scaled_dot_product_flash_attention_for_cpu:
               aten._scaled_dot_product_flash_attention}


def is_heavy(func: Any) -> bool:
    """An operator the FLOP counter counts: the calls a forward and its recomputation number."""
    packet = func._overloadpacket
    return packet in flop_registry or packet in _SAME_FLOPS


def heavy_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of a heavy operator the policy may store (0: always recomputed)."""
    packet = func._overloadpacket
    formula = flop_registry.get(_SAME_FLOPS.get(packet, packet))
    if formula is None:
        return 0
    if torch.Tag.nondeterministic_seeded in func.tags and _dropout(func, args, kwargs) != 0.0:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def _dropout(func: Any, args: tuple, kwargs: dict) -> float:
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return 1.0  # random by its tag, and no way to switch that off
    pos = names.index("dropout_p")
    return float(args[pos] if pos < len(args) else kwargs.get("dropout_p", 0.0))


@functools.cache
def _written_positions(func: Any) -> tuple[int, ...]:
    """Positions of the arguments an operator writes in place (its schema's, read once: the
    recorder asks on every mutating call)."""
    return tuple(j for j, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _nbytes(out: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(out)
               if isinstance(t, torch.Tensor))


@dataclass
class HeavyOp:
    """One heavy operator call of a sub-model's forward, in call order."""

    func: Any
    flops: int
    nbytes: int
    key: tuple = ()  # the operator and its arguments' shapes and dtypes (call_key)


def call_key(func: Any, args: tuple, kwargs: dict) -> tuple:
    """What tells two heavy calls apart when a forward and its recomputation are matched: the
    operator and the shapes and dtypes of its tensor arguments (the linears of one block
    differ by their weights' and biases' shapes)."""
    return (str(func), *((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else None
                         for a in tree_leaves((args, kwargs))))


def choose(ops: list[HeavyOp], kept_bytes: int, sent_bytes: int) -> dict[int, str]:
    """Call number -> "k" (keep) or "s" (send): the most FLOPs per byte first, each quota filled
    as far as the next candidate fits."""
    order = sorted(range(len(ops)), key=lambda j: (-ops[j].flops / max(ops[j].nbytes, 1), j))
    out: dict[int, str] = {}
    room = {"k": kept_bytes, "s": sent_bytes}
    for j in order:
        if ops[j].flops <= 0:
            continue
        for letter in "ks":
            if ops[j].nbytes <= room[letter]:
                room[letter] -= ops[j].nbytes
                out[j] = letter
                break
    return out


@dataclass
class _Stored:
    func: Any
    value: Any  # the outputs on the device (None while only the host copy exists)
    host: list[torch.Tensor] | None = None  # sent: host buffers of the tensor leaves
    ready: Any = None  # CUDA event after the copy to the host
    leaves: list[Any] | None = None  # sent: the outputs' leaves, tensors as _TENSOR
    spec: Any = None  # sent: the outputs' tree structure


@dataclass
class _Pass:
    """What one forward of sub-model i, micro-batch m stored: call number -> outputs."""

    stored: dict[int, _Stored] = field(default_factory=dict)


class OpCache(HostCopies):
    """Keeps and sends heavy operators' outputs per the plan's quotas (module docstring)."""

    def __init__(self, quotas: list[tuple[int, int]], lanes: CopyLanes):
        super().__init__(lanes)  # buffers: (sub-model, micro-batch, call, leaf) of a sent output
        self.quotas = quotas  # per sub-model: (kept, sent) bytes of one micro-batch
        self.choices: dict[int, dict[int, str]] = {}  # sub-model -> its stored calls
        self.ops: dict[int, list[HeavyOp]] = {}  # sub-model -> its heavy calls (first forward)
        # sub-model -> recomputation's call number -> the forward's (first backward)
        self.matched: dict[int, dict[int, int]] = {}
        self.passes: dict[tuple[int, int], _Pass] = {}
        self.held = 0  # device bytes of kept outputs now
        self.peak_held = 0  # ... at most, since the cache was made

    def active(self, i: int) -> bool:
        return i < len(self.quotas) and any(self.quotas[i])

    def recording(self, i: int, m: int) -> TorchDispatchMode:
        return _Recorder(self, i, m)

    def replaying(self, i: int, m: int) -> TorchDispatchMode:
        p = self.passes.pop((i, m), _Pass())
        self.held -= sum(_nbytes(s.value) for s in p.stored.values() if s.host is None)
        return _Replayer(self, i, p)

    # ---- what is stored (the plan's accounting is checked against these) ----------------------

    def sent_bytes(self) -> int:
        return sum(sum(h.numel() * h.element_size() for h in s.host)
                   for p in self.passes.values() for s in p.stored.values() if s.host)

    @property
    def host(self) -> dict[tuple[int, int, int, int], torch.Tensor]:
        return self.buffers.host

    @property
    def arena(self) -> HostArena | None:
        return self.buffers.arena

    def pinned_bytes(self) -> int:
        return self.buffers.pinned_bytes()

    # ---- sends and fetches ----------------------------------------------------------------------

    def _send(self, i: int, m: int, call: int, s: _Stored) -> None:
        flat, s.spec = tree_flatten(s.value)
        leaves = [t for t in flat if isinstance(t, torch.Tensor)]
        s.leaves = [_TENSOR if isinstance(t, torch.Tensor) else t for t in flat]
        s.host = [self.buffers.buffer((i, m, call, j), t) for j, t in enumerate(leaves)]
        nbytes = _nbytes(leaves)
        if self.cuda:
            os_ = self.offload_stream
            os_.wait_stream(self.compute_stream)
            with torch.cuda.stream(os_), self.tracer.span("offload", i, "activation_out", os_,
                                                          nbytes):
                for h, t in zip(s.host, leaves):
                    h.copy_(t, non_blocking=True)
                    t.record_stream(os_)
            s.ready = torch.cuda.Event()
            s.ready.record(os_)
        else:
            with self.tracer.span("offload", i, "activation_out", None, nbytes):
                for h, t in zip(s.host, leaves):
                    h.copy_(t)
        s.value = None  # the device copy is freed (on CUDA once the copy is done)

    def end_step(self) -> None:
        self.buffers.end_step()

    def fetch(self, i: int) -> None:
        """Issue the copies of sub-model i's sent outputs back to the device, micro-batch by
        micro-batch (on the prefetch stream, with its stashed boundary values)."""
        for (j, m), p in sorted(self.passes.items()):
            if j != i:
                continue
            sent = [s for s in p.stored.values() if s.host is not None and s.value is None]
            if not sent:
                continue
            nbytes = sum(_nbytes(s.host) for s in sent)
            stream = self.prefetch_stream
            if self.cuda:
                for s in sent:
                    stream.wait_event(s.ready)
            with (torch.cuda.stream(stream) if self.cuda else nullcontext()), \
                    self.tracer.span("prefetch", i, "checkpoint", stream, nbytes):
                for s in sent:
                    devs = iter([torch.empty_like(h, device=self.device).copy_(
                        h, non_blocking=self.cuda) for h in s.host])
                    s.value = tree_unflatten([next(devs) if t is _TENSOR else t
                                              for t in s.leaves], s.spec)
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record(stream)
                self._back_ready[(i, m)] = ready
                for s in sent:
                    for d in tree_leaves(s.value):
                        if isinstance(d, torch.Tensor):
                            d.record_stream(self.compute_stream)

    def ready(self, i: int, m: int) -> None:
        """Make the compute stream wait for micro-batch m's fetched outputs of sub-model i."""
        event = self._back_ready.pop((i, m), None)
        if event is not None:
            self.compute_stream.wait_event(event)

    def clear(self) -> None:
        """Drop what an abandoned step stored."""
        self.passes.clear()
        self.held = 0
        self._back_ready.clear()


class _Recorder(TorchDispatchMode):
    """Sub-model i's forward of micro-batch m: stores the outputs of the chosen heavy calls."""

    def __init__(self, cache: OpCache, i: int, m: int):
        super().__init__()
        self.cache = cache
        self.i = i
        self.m = m
        self.call = 0
        self.survey = i not in cache.ops
        self.ops: list[HeavyOp] = []
        self.choice = cache.choices.get(i, {})
        self.p = _Pass()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.is_mutable and self.p.stored:
            self._before_write(func, args, kwargs)
        out = func(*args, **kwargs)
        if not is_heavy(func):
            return out
        call = self.call
        self.call += 1
        if self.survey:  # FLOPs and keys once, in the first forward
            self.ops.append(HeavyOp(func, heavy_flops(func, args, kwargs, out), _nbytes(out),
                                    call_key(func, args, kwargs)))
        elif call in self.choice:
            self.p.stored[call] = _Stored(func, tree_map(
                lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out))
        return out

    def _before_write(self, func: Any, args: tuple, kwargs: dict) -> None:
        values = [*args, *kwargs.values()]
        written = {values[j].untyped_storage().data_ptr() for j in _written_positions(func)
                   if j < len(values) and isinstance(values[j], torch.Tensor)}
        for s in self.p.stored.values():
            if s.host is not None:
                continue
            leaves = [t for t in tree_leaves(s.value) if isinstance(t, torch.Tensor)]
            if any(t.untyped_storage().data_ptr() in written for t in leaves):
                s.value = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                                   s.value)

    def __exit__(self, *exc: object) -> Any:
        result = super().__exit__(*exc)
        if exc[0] is not None:
            return result
        c = self.cache
        if self.survey:
            c.ops[self.i] = self.ops
        else:
            for call, s in self.p.stored.items():
                if self.choice[call] == "s":
                    c._send(self.i, self.m, call, s)
                else:
                    c.held += _nbytes(s.value)
            c.peak_held = max(c.peak_held, c.held)
            c.passes[(self.i, self.m)] = self.p
        return result


class _Replayer(TorchDispatchMode):
    """Sub-model i's recomputation: the stored calls return what the forward stored.

    Without an autograd graph the forward may pick other kernels than the recomputation with
    one (an attention whose fused kernel has no backward for these inputs runs as matmuls):
    the first recomputation lists its heavy calls, the two lists are matched (difflib, by
    operator and argument shapes), and only calls both run the same are ever stored."""

    def __init__(self, cache: OpCache, i: int, p: _Pass):
        super().__init__()
        self.cache = cache
        self.i = i
        self.p = p
        self.call = 0
        self.matched = cache.matched.get(i)
        self.keys: list[tuple] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not is_heavy(func):
            return func(*args, **kwargs)
        call = self.call
        self.call += 1
        if self.matched is None:
            self.keys.append(call_key(func, args, kwargs))
            return func(*args, **kwargs)
        forward_call = self.matched.get(call)
        s = None if forward_call is None else self.p.stored.pop(forward_call, None)
        if s is None:
            return func(*args, **kwargs)
        if s.func is not func:
            raise AtomcError(
                f"sub-model {self.i}: its recomputation ran {func} where its forward ran "
                f"{s.func} (call {call}); the forward and its recomputation must run the same "
                "operators: train with --activations recompute and report the model")
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, s.value)

    def __exit__(self, *exc: object) -> Any:
        result = super().__exit__(*exc)
        c = self.cache
        if exc[0] is None and self.matched is None and self.i in c.ops:
            ops = c.ops[self.i]
            blocks = difflib.SequenceMatcher(None, [o.key for o in ops], self.keys,
                                             autojunk=False).get_matching_blocks()
            pairs = {b.b + k: b.a + k for b in blocks for k in range(b.size)}
            c.matched[self.i] = pairs
            same = set(pairs.values())
            c.choices[self.i] = choose([o if j in same else HeavyOp(o.func, 0, o.nbytes)
                                        for j, o in enumerate(ops)], *c.quotas[self.i])
        return result
