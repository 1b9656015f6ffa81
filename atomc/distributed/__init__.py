"""Stage 7, beyond one machine: a generated package trained over many processes.

Two modes (docs/design.md, sections "Place: DT-FM layouts" and "Peers and SWARM"):

- **Layouts** (DT-FM): `atomc launch layout.json -- examples/train_layout.py ...` starts the
  layout's D_PP x D_DP processes under torchrun (elastic, c10d rendezvous). Each rank finds its
  (replica, stage) (`groups`), builds its stage from the package's sub-models - resident, or
  with the swap runtime when it does not fit (atomc.stages) - and trains it in a GPipe or
  1F1B schedule with asynchronous activation/gradient sends (`pipeline`); tied weights are summed
  across stages, stage gradients averaged by hand over the data-parallel group, then the
  optimizer steps; per-stage checkpoints make restarts resume (`runner`).
- **Peers** (ATOM's decentralized mode): `atomc peer --initial-peers ADDR examples/train_peer.py
  ...` starts one peer that trains a full copy with the swap runtime and averages with the other
  peers (hivemind DHT and averager) whenever they have processed a global batch together (`peer`).

`netem` builds emulated networks (namespaces, veth, tc) for `bench/layout_bench.py`.
"""

from atomc.distributed.groups import LayoutView, Placement, assign, layout_view, load_layout

__all__ = [
           "LayoutView",
           "Placement",
           "assign",
           "layout_view",
           "load_layout",
]
