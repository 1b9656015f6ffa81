"""The layout runner's gradient sums over a process group: one flat buffer per dtype, by
torch.distributed's all-reduce or, over point-to-point sends, DT-FM's sharded exchange (eq. 2)
or a direct swap of whole buffers; emulated link delays apply to each round.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from atomc.distributed.pipeline import Transport


class Collectives:
    """Sums over groups of ranks; `mode` "p2p" sends point to point, else all-reduce."""

    def __init__(self, dist: Any, device: torch.device, mode: str, transport: Transport):
        self.dist, self.device, self.mode, self.transport = dist, device, mode, transport

    def sum(self, grads: list[torch.Tensor], group: Any, ranks: list[int], tag: int,
            average: bool, direct: bool = False) -> None:
        """Sum (or average) gradients over `ranks` in one flat buffer per dtype. Over point-to-point
        sends, `direct` swaps whole buffers in one round (one link delay; for the few stages that
        share a tied weight), otherwise DT-FM's sharded exchange (two rounds, 1/n of the bytes
        each). The buffer is on this rank's device (a swapped stage's gradients live in host
        memory, which NCCL cannot send)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in gs]).to(self.device)
            if self.mode == "p2p":
                flat = self.direct_sum(flat, ranks, group, tag) if direct else \
                    self.sharded_sum(flat, ranks, group, tag)
            else:
                self.dist.all_reduce(flat, group=group)
            if average:
                flat /= len(ranks)
            off = 0
            for g in gs:
                n = g.numel()
                g.copy_(flat[off:off + n].view_as(g))
                off += n

    def exchange(self, group: Any, sends: list[tuple[torch.Tensor, int]],
                  recvs: list[tuple[torch.Tensor, int]], tag: int) -> None:
        """One symmetric round of point-to-point messages inside `group`, all posted together with
        dist.batch_isend_irecv (NCCL runs them as one group call: every rank sending before it
        receives cannot block), then waited for. With emulated link delays the round is posted
        after the largest delay to its peers, when the slowest message would have arrived."""
        dist = self.dist
        delay = self.transport.delay_s([r for _, r in sends])
        if delay > 0:
            time.sleep(delay)
        ops = [dist.P2POp(dist.isend, t, r, group, tag) for t, r in sends]
        ops += [dist.P2POp(dist.irecv, t, r, group, tag) for t, r in recvs]
        self.transport.bytes_sent += sum(t.numel() * t.element_size() for t, _ in sends)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def sharded_sum(self, flat: torch.Tensor, ranks: list[int], group: Any,
                     tag: int) -> torch.Tensor:
        """DT-FM's sharded parameter server (eq. 2) over point-to-point sends: rank k owns shard
        k, sums it from every peer (in group order, so all ranks end with identical bits) and
        sends the sum back. Emulated link delays apply to each of the two rounds."""
        me = ranks.index(self.dist.get_rank())
        n = len(ranks)
        bounds = [flat.numel() * k // n for k in range(n + 1)]

        def shard(k: int) -> torch.Tensor:
            return flat[bounds[k]:bounds[k + 1]]

        peers = [k for k in range(n) if k != me]
        parts = {k: torch.empty_like(shard(me)) for k in peers}
        self.exchange(group, [(shard(k).contiguous(), ranks[k]) for k in peers],
                       [(parts[k], ranks[k]) for k in peers], tag)
        total = None
        for k in range(n):
            part = shard(me) if k == me else parts[k]
            total = part.clone() if total is None else total + part
        out = torch.empty_like(flat)
        out[bounds[me]:bounds[me + 1]] = total
        # contiguous views, received in place
        back = {k: out[bounds[k]:bounds[k + 1]] for k in peers}
        self.exchange(group, [(total, ranks[k]) for k in peers],
                       [(back[k], ranks[k]) for k in peers], tag + 1)
        return out

    def direct_sum(self, flat: torch.Tensor, ranks: list[int], group: Any,
                    tag: int) -> torch.Tensor:
        """Every rank sends its whole buffer to every other and sums all of them in group order."""
        me = ranks.index(self.dist.get_rank())
        peers = [k for k in range(len(ranks)) if k != me]
        parts = {k: torch.empty_like(flat) for k in peers}
        self.exchange(group, [(flat, ranks[k]) for k in peers],
                       [(parts[k], ranks[k]) for k in peers], tag)
        total = None
        for k in range(len(ranks)):
            part = flat if k == me else parts[k]
            total = part.clone() if total is None else total + part
        return total


__all__ = ["Collectives"]
