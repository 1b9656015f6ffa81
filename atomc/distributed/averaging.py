"""Peers, the averaging of the weights: the vector a round averages (`round_vector`, and
`set_round_vector` to take the average back), the digest that shows two peers hold the same
weights, and the hivemind averager a peer runs its rounds with (`make_averager`: the weights' own
rounds and DiLoCo's pseudo-gradient rounds)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from atomc.distributed.peerconfig import PeerConfig
from atomc.distributed.rounds import register_codecs, round_bytes


def round_vector(trainer: Any) -> torch.Tensor:
    """What a round averages, as one vector in the master dtype (float64 runs average in
    float64): every master weight, then every persistent buffer, so that BatchNorm's running
    statistics are averaged with the weights they belong to (as the weights' own rule, weighted
    by samples). Optimizer state stays local, as in ATOM."""
    buffers = trainer.persistent_buffers()  # first: it waits for the step's updates
    dtype = trainer.store.master_dtype
    store = trainer.store
    parts = [store.read_master(i).reshape(-1).to(dtype) for i in range(len(store.layouts))]
    parts += [b.detach().reshape(-1).to(dtype) for _, _, b in buffers]
    return torch.cat(parts)


def set_round_vector(trainer: Any, flat: torch.Tensor) -> None:
    """Load a vector `round_vector` laid out (averaged) into `trainer`; integer buffers (batch
    counters) take the rounded average."""
    buffers = trainer.persistent_buffers()
    state = trainer.state_dict()
    off = 0
    for i, m in enumerate(state["masters"]):
        n = m.numel()
        state["masters"][i] = flat[off:off + n].view_as(m).to(m.dtype)
        off += n
    for i, name, b in buffers:
        n = b.numel()
        value = flat[off:off + n].view_as(b)
        state["buffers"][i][name] = (value if b.is_floating_point() else value.round()).to(b.dtype)
        off += n
    trainer.load_state_dict(state, source="averaged weights")


def weights_digest(trainer: Any) -> str:
    from atomc.runtime.checkpoint import digest

    store = trainer.store
    return digest([store.read_master(i) for i in range(len(store.layouts))])


def average_weights(averager: Any, trainer: Any, *, name: str, epoch: int, weight: float,
                    timeout_s: float, log: Callable[[str], None]
                    ) -> tuple[dict[str, int], tuple[int, int]]:
    """One averaging round of `trainer`'s weights (`round_vector`) on `averager` with the peers
    looking for a group now. Returns what each member sent along, {name: epoch} ({} when no
    group formed or the round failed: the weights stay local), and this peer's (sent,
    received) bytes ((0, 0) unless it is a named member of the group)."""
    flat = round_vector(trainer)
    with averager.get_tensors() as tensors:
        tensors[0].copy_(flat)
    group = None
    try:
        group = averager.step(weight=weight, gather={"name": name, "epoch": epoch},
                              timeout=timeout_s, allow_retries=True)
    except Exception as e:  # noqa: BLE001 - a groupmate died mid-round: keep the local weights
        log(f"round {epoch}: averaging failed ({type(e).__name__}: {e})")
    if not group:
        return {}, (0, 0)
    with averager.get_tensors() as tensors:
        averaged = tensors[0].clone()
    set_round_vector(trainer, averaged)
    names = [v.get("name") if isinstance(v, dict) else None for v in group.values()]
    moved = (0, 0)
    if name in names:
        moved = round_bytes([(flat.numel(), None, trainer.store.master_dtype.itemsize)],
                            len(group), names.index(name))
    members = {str(v["name"]): int(v["epoch"]) for v in group.values() if isinstance(v, dict)}
    return members, moved


def make_averager(hm: Any, tensors: list[torch.Tensor], dht: Any, cfg: PeerConfig,
                   current_state: Callable | None, *, prefix: str | None = None,
                   compression: Any = None) -> Any:
    """A DecentralizedAverager with atomc peer's settings over `tensors`; it serves
    `current_state()` to joining peers (None: it shares no state)."""
    dtype = tensors[0].dtype

    class PeerAverager(hm.averaging.DecentralizedAverager):
        def get_current_state(self):  # runs in this process when a peer downloads our state
            return current_state()

        def run(self):  # the averager's own process
            # hivemind sums every part in a tensor of torch's default dtype (float32): a float64
            # run's rounds would be float32-exact only; and the round codecs (rounds.py)
            torch.set_default_dtype(dtype)
            register_codecs()
            super().run()

    extra: dict[str, Any] = {} if compression is None else {"compression": compression}
    if current_state is None:
        extra["allow_state_sharing"] = False
    return PeerAverager(tensors, dht, start=True, prefix=prefix or f"{cfg.run_id}_averaging",
                        min_group_size=2, **extra,
                        min_matchmaking_time=cfg.matchmaking_time_s,
                        request_timeout=min(3.0, cfg.matchmaking_time_s / 2),
                        allreduce_timeout=cfg.averaging_timeout_s, next_chunk_timeout=10.0,
                        client_mode=False, declare_state_period=2.0)


__all__ = ["average_weights", "make_averager", "round_vector", "set_round_vector", "weights_digest"]
