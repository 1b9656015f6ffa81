"""The outer optimizer of `atomc peer`: DiLoCo's outer step over rounds of local steps.

input:  the outer options (`OuterConfig`: sgd or nesterov, learning rate, momentum, local steps
        between rounds, the round's dtype, fragments), the sub-models' master sizes
output: the fragments (`fragments_of`: consecutive sub-models), the outer state
        (`OuterOptimizer`: every fragment's weights at its round's start and torch's SGD over
        them) and the host bytes a peer holds beside its swap trainer (`peer_host_bytes`)

DiLoCo (arXiv 2311.08105): each peer takes H local AdamW steps (the swap runtime's CPU AdamW,
unchanged), then the peers average their pseudo-gradients (the weights at the round's start
minus the weights now) and every peer applies one outer step to the round's start weights:
SGD, or SGD with Nesterov momentum (DiLoCo's lr 0.7, momentum 0.9). ATOM's averaging is the
outer SGD at learning rate 1 without momentum and with exact rounds: every peer's new weights
are the average, so `OuterConfig.plain` runs take today's path (the weights averaged, as
before), which gives exactly the bits it gave; every other setting averages pseudo-gradients.

Streaming DiLoCo (arXiv 2501.18512): with K fragments a round averages one fragment (sub-models
in turn) every H/K local steps, so each fragment still sees a round every H steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from atomc.distributed.rounds import DTYPE_BYTES, check_round_dtype, tensor_dtype
from atomc.errors import PeerError, UsageError
from atomc.partition.hostmem import aligned
from atomc.runtime.disk import StateFiles, aligned_buffer, check_dirs
from atomc.units import format_bytes

OUTERS = ("sgd", "nesterov")
# DiLoCo's outer Nesterov settings (the paper's main runs); sgd defaults to ATOM's averaging
DEFAULT_LR = {"sgd": 1.0, "nesterov": 0.7}
DEFAULT_MOMENTUM = {"sgd": 0.0, "nesterov": 0.9}


@dataclass(frozen=True)
class OuterConfig:
    """The outer options every peer of a run must share (`disagreement` names a difference)."""

    outer: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.0
    inner_steps: int | None = None  # local steps between rounds (None: the global batch rule)
    round_dtype: str | None = None  # what pseudo-gradients travel in (None: the master dtype)
    fragments: int = 1  # sub-model groups averaged in turn, one a round

    def __post_init__(self) -> None:
        if self.outer not in OUTERS:
            raise UsageError(f"--outer {self.outer!r} is not one of {', '.join(OUTERS)}; give "
                             f"sgd (lr 1: ATOM's averaging) or nesterov (DiLoCo)")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise UsageError(f"--outer-lr {self.lr!r}: the outer learning rate must be a positive "
                             f"number; give 1 (ATOM's averaging) or about 0.7 (DiLoCo, nesterov)")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise UsageError(f"--outer-momentum {self.momentum!r}: expected a number in [0, 1), "
                             f"e.g. 0.9 (DiLoCo)")
        if self.outer == "nesterov" and self.momentum == 0:
            raise UsageError("--outer nesterov with --outer-momentum 0 has no momentum to look "
                             "ahead with; give a momentum (DiLoCo: 0.9) or --outer sgd")
        if self.inner_steps is not None and self.inner_steps < 1:
            raise UsageError(f"--inner-steps {self.inner_steps}: a round needs at least one local "
                             f"step before it; give H >= 1 (DiLoCo: 500; leave it out for the "
                             f"global batch rule)")
        if self.fragments < 1:
            raise UsageError(f"--fragments {self.fragments}: expected 1 (every sub-model each "
                             f"round) or more")
        if self.inner_steps is not None and self.inner_steps % self.fragments:
            raise UsageError(f"--inner-steps {self.inner_steps} does not split into "
                             f"--fragments {self.fragments} rounds of whole local steps; give a "
                             f"multiple of {self.fragments}")
        check_round_dtype(self.round_dtype)

    @classmethod
    def make(cls, outer: str = "sgd", lr: float | None = None, momentum: float | None = None,
             inner_steps: int | None = None, round_dtype: str | None = None,
             fragments: int = 1) -> OuterConfig:
        """The options with their outer's defaults where not given."""
        if outer not in OUTERS:
            cls(outer=outer)  # the one-line error
        return cls(outer=outer, lr=DEFAULT_LR[outer] if lr is None else float(lr),
                   momentum=DEFAULT_MOMENTUM[outer] if momentum is None else float(momentum),
                   inner_steps=inner_steps, round_dtype=round_dtype, fragments=fragments)

    def plain(self, master_dtype: str = "float32") -> bool:
        """ATOM's averaging: outer SGD at lr 1, no momentum, exact rounds (the master dtype) of
        every sub-model."""
        return (self.outer == "sgd" and self.lr == 1.0 and self.momentum == 0.0
                and self.round_dtype in (None, master_dtype) and self.fragments == 1)

    @property
    def steps_per_round(self) -> int | None:
        """Local steps between two rounds (each round averages one of the fragments)."""
        return None if self.inner_steps is None else self.inner_steps // self.fragments

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "<data>") -> OuterConfig:
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise PeerError(f"{source}: outer options {data!r} are not atomc peer's "
                            f"({', '.join(sorted(names))}); every peer must run one atomc")
        return cls(**data)

    def describe(self) -> str:
        """The options as `atomc peer` flags."""
        out = [f"--outer {self.outer}", f"--outer-lr {self.lr:g}"]
        if self.momentum:
            out.append(f"--outer-momentum {self.momentum:g}")
        out.append(f"--inner-steps {self.inner_steps}" if self.inner_steps is not None
                   else "(global batch rule)")
        out.append(f"--round-dtype {self.round_dtype or 'master'}")
        out.append(f"--fragments {self.fragments}")
        return " ".join(out)

    def disagreement(self, other: OuterConfig) -> str:
        """'' when the options agree, else the differing options as `mine` vs `other`'s."""
        flags = {"outer": "--outer", "lr": "--outer-lr", "momentum": "--outer-momentum",
                 "inner_steps": "--inner-steps", "round_dtype": "--round-dtype",
                 "fragments": "--fragments"}
        diffs = []
        for name, flag in flags.items():
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                diffs.append((flag, _shown(a, name), _shown(b, name)))
        if not diffs:
            return ""
        mine = " ".join(f"{f} {a}" for f, a, _ in diffs)
        theirs = " ".join(f"{f} {b}" for f, _, b in diffs)
        return f"{mine} here, {theirs} there"


def _shown(value: Any, name: str) -> str:
    if value is None:
        return "(global batch rule)" if name == "inner_steps" else "(master dtype)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def fragments_of(sizes: Sequence[int], k: int) -> list[list[int]]:
    """Sub-model indices in `k` groups of consecutive sub-models whose largest group holds as
    few values as can be (`sizes`: each sub-model's master values); UsageError for more groups
    than sub-models."""
    n = len(sizes)
    if k > n:
        raise UsageError(f"--fragments {k} is more than the package's {n} sub-models; a "
                         f"fragment is one or more whole sub-models: give at most {n}")
    if k < 1:
        raise UsageError(f"--fragments {k}: expected 1 or more")
    # the smallest largest-group size for which a greedy cut makes at most k groups (binary
    # search over sizes): the classic linear partition
    lo, hi = max(sizes, default=0), sum(sizes)

    def cuts(limit: int) -> list[list[int]]:
        groups: list[list[int]] = [[]]
        total = 0
        for i, s in enumerate(sizes):
            if groups[-1] and total + s > limit:
                groups.append([])
                total = 0
            groups[-1].append(i)
            total += s
        return groups

    while lo < hi:
        mid = (lo + hi) // 2
        if len(cuts(mid)) <= k:
            hi = mid
        else:
            lo = mid + 1
    groups = cuts(lo)
    while len(groups) < k:  # fewer groups fit the limit: split the largest further (k <= n)
        big = max((g for g in groups if len(g) > 1), key=lambda g: sum(sizes[i] for i in g))
        at = groups.index(big)
        half = len(big) // 2
        groups[at:at + 1] = [big[:half], big[half:]]
    return groups


class OuterOptimizer:
    """Each fragment's weights at the start of its round (one flat vector in the master dtype)
    and torch's SGD over them: `step(f, averaged pseudo-gradient)` is the outer step, and
    returns the fragment's new weights."""

    def __init__(self, starts: Sequence[torch.Tensor], cfg: OuterConfig):
        self.cfg = cfg
        self.starts = [torch.nn.Parameter(s.detach().clone(), requires_grad=False)
                       for s in starts]
        self.opt = _sgd(self.starts, cfg)

    @property
    def disk_bytes(self) -> int:
        return 0

    def reset(self, f: int, weights: torch.Tensor) -> None:
        with torch.no_grad():
            self.starts[f].copy_(weights)

    def pseudo_gradient(self, f: int, weights: torch.Tensor) -> torch.Tensor:
        """The start weights minus the weights now: what the round averages."""
        return self.starts[f].detach() - weights

    @torch.no_grad()
    def step(self, f: int, averaged: torch.Tensor) -> torch.Tensor:
        for p in self.starts:
            p.grad = None
        start = self.starts[f]
        start.grad = averaged.to(start.dtype).reshape(start.shape)
        self.opt.step()
        start.grad = None
        return start.detach()

    def state_dict(self) -> dict[str, Any]:
        return {"starts": [s.detach().clone() for s in self.starts],
                "opt": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any], source: str) -> None:
        _check_starts(state, [s.numel() for s in self.starts], source)
        with torch.no_grad():
            for s, v in zip(self.starts, state["starts"]):
                s.copy_(v)
        self.opt.load_state_dict(state["opt"])

    def close(self) -> None:
        pass


class DiskOuterOptimizer:
    """OuterOptimizer's state in files on the offload drives (atomc.runtime.disk), one record a
    fragment: its start weights, then its momentum. A round reads its fragment's record, takes
    torch's SGD step on it and writes it back, so the host holds one fragment's state at a
    time; the steps are torch's own, bit for bit what OuterOptimizer takes. For runs whose
    plan puts the masters on disk: the outer state is as large as they are, or twice."""

    def __init__(self, starts: Sequence[torch.Tensor], cfg: OuterConfig, drives: Sequence[Any]):
        self.cfg = cfg
        self.dtype = starts[0].dtype
        self.sizes = [s.numel() for s in starts]
        self.momentum = cfg.momentum > 0
        # per record: the start weights at 0, the momentum at `second[f]`
        self.second = [aligned(n * self.dtype.itemsize) for n in self.sizes]
        records = [(2 if self.momentum else 1) * b for b in self.second]
        checked = check_dirs([d.path for d in drives], sum(records))
        self.files = StateFiles(checked, records)
        self.buffer = aligned_buffer(max(records))
        self.has_momentum = [False] * len(starts)  # torch makes the buffer at the first step
        try:
            for f, s in enumerate(starts):
                self._write(f, s.detach(), None)
        except BaseException:
            self.files.close()
            raise

    @property
    def disk_bytes(self) -> int:
        return sum(self.files.sizes)

    def _views(self, f: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, b = self.sizes[f], self.second[f]
        start = self.buffer[:n * self.dtype.itemsize].view(self.dtype)
        momentum = (self.buffer[b:b + n * self.dtype.itemsize].view(self.dtype)
                    if self.momentum else None)
        return start, momentum

    def _read(self, f: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.files.read(f, self.buffer).result()
        return self._views(f)

    def _write(self, f: int, start: torch.Tensor, momentum: torch.Tensor | None) -> None:
        here, there = self._views(f)
        if start.data_ptr() != here.data_ptr():
            here.copy_(start.reshape(-1))
        if there is not None:
            if momentum is None:
                there.zero_()
            elif momentum.data_ptr() != there.data_ptr():
                there.copy_(momentum.reshape(-1))
        self.files.write(f, self.buffer).result()

    def reset(self, f: int, weights: torch.Tensor) -> None:
        _, momentum = self._read(f)
        self._write(f, weights, momentum)

    def pseudo_gradient(self, f: int, weights: torch.Tensor) -> torch.Tensor:
        start, _ = self._read(f)
        return start - weights

    @torch.no_grad()
    def step(self, f: int, averaged: torch.Tensor) -> torch.Tensor:
        start, momentum = self._read(f)
        param = torch.nn.Parameter(start, requires_grad=False)
        opt = _sgd([param], self.cfg)
        if self.has_momentum[f]:
            opt.state[param]["momentum_buffer"] = momentum
        param.grad = averaged.to(self.dtype).reshape(param.shape)
        opt.step()
        if self.momentum:
            momentum.copy_(opt.state[param]["momentum_buffer"])  # torch's own at the first
            self.has_momentum[f] = True
        self._write(f, start, momentum)
        return start.clone()

    def state_dict(self) -> dict[str, Any]:
        """OuterOptimizer's form: the start weights and torch's SGD state over them."""
        starts, buffers = [], []
        for f in range(len(self.sizes)):
            start, momentum = self._read(f)
            starts.append(start.clone())
            buffers.append(momentum.clone() if self.has_momentum[f] else None)
        params = [torch.nn.Parameter(s, requires_grad=False) for s in starts]
        opt = _sgd(params, self.cfg)
        for p, m in zip(params, buffers):
            if m is not None:
                opt.state[p]["momentum_buffer"] = m
        return {"starts": starts, "opt": opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any], source: str) -> None:
        _check_starts(state, self.sizes, source)
        params = [torch.nn.Parameter(s.detach().clone().to(self.dtype), requires_grad=False)
                  for s in state["starts"]]
        opt = _sgd(params, self.cfg)
        opt.load_state_dict(state["opt"])
        for f, p in enumerate(params):
            m = opt.state.get(p, {}).get("momentum_buffer") if self.momentum else None
            self.has_momentum[f] = m is not None
            self._write(f, p.detach(), m)

    def close(self) -> None:
        self.files.close()


def _sgd(params: Sequence[torch.nn.Parameter], cfg: OuterConfig) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                           nesterov=cfg.outer == "nesterov")


def _check_starts(state: Any, sizes: Sequence[int], source: str) -> None:
    starts = state.get("starts") if isinstance(state, dict) else None
    if (not isinstance(starts, list) or len(starts) != len(sizes)
            or any(a.numel() != n for a, n in zip(starts, sizes))):
        raise PeerError(f"{source}: its outer state has "
                        f"{len(starts) if isinstance(starts, list) else 'no'} fragments of "
                        f"other sizes than this peer's {len(sizes)}; give every peer "
                        f"the same package and --fragments")


def peer_host_bytes(total_values: int, fragment_values: int, buffer_values: int,
                    master_dtype: str, state_bytes: int, cfg: OuterConfig,
                    outer_on_disk: bool = False) -> dict[str, int]:
    """Host bytes a peer holds beside its swap trainer, by kind (what `atomc peer` checks at
    start; a plan can add them to atomc.partition.hostmem's kinds):

    - `averaged_weights`: the weights averager's vector (every master and persistent buffer:
      rounds of ATOM's averaging and the final rounds), in the master dtype;
    - `shared_state`: the trainer's state (masters, AdamW moments) serialized for joining
      peers, `state_bytes` of it, and the outer state's copy beside it;
    - `outer_state`: each fragment's start weights, and the outer momentum; with
      `outer_on_disk` (DiskOuterOptimizer, where the plan puts the masters on disk) one
      fragment's of them, read for its round;
    - `round_buffers`: the round averager's vector (the largest fragment and its buffers, in
      the averaged tensor's dtype), and the fragment's pseudo-gradient and weights at launch.
    """
    mb = DTYPE_BYTES[master_dtype]
    out = {"averaged_weights": (total_values + buffer_values) * mb, "shared_state": state_bytes,
           "outer_state": 0, "round_buffers": 0}
    if cfg.plain(master_dtype):
        return out
    per_value = mb * (2 if cfg.momentum > 0 else 1)
    outer = total_values * per_value
    tb = DTYPE_BYTES[tensor_dtype(cfg.round_dtype, master_dtype)]
    out["outer_state"] = fragment_values * per_value if outer_on_disk else outer
    out["shared_state"] += outer
    out["round_buffers"] = (fragment_values + buffer_values) * tb + 2 * fragment_values * mb
    return out


WORDS = {"averaged_weights": "averaged weights", "shared_state": "state shared with joining peers",
         "outer_state": "outer state (start weights, momentum)", "round_buffers": "round buffers"}


def describe_host_bytes(by_kind: dict[str, int]) -> str:
    parts = [f"{format_bytes(v)} {WORDS[k]}" for k, v in by_kind.items() if v]
    return f"{format_bytes(sum(by_kind.values()))} ({' + '.join(parts) or 'nothing'})"


def check_host_bytes(by_kind: dict[str, int], available: int | None) -> None:
    """UsageError in one line when the peer's own host bytes exceed what is available after
    its swap trainer took its share (None: no figure on this system, not checked)."""
    need = sum(by_kind.values())
    if available is None or need <= available:
        return
    raise UsageError(f"atomc peer: host memory: the peer needs {describe_host_bytes(by_kind)} "
                     f"beside its swap trainer, more than the {format_bytes(available)} "
                     f"available; try --fragments K (a round buffer of one fragment), "
                     f"--outer sgd without momentum, or a machine with more memory")


__all__ = ["DEFAULT_LR", "DEFAULT_MOMENTUM", "OUTERS", "DiskOuterOptimizer", "OuterConfig",
           "OuterOptimizer", "check_host_bytes", "describe_host_bytes", "fragments_of",
           "peer_host_bytes"]
