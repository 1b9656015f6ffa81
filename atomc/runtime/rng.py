"""Runtime, the RNG rule (dropout), owned here for every runtime: swap trainer, stages, peers.

Micro-batch m of step s draws from its own generator stream, seeded with
micro_batch_seed(seed, s, m), and consumes it in model order, sub-model after sub-model: the
order in which the unpartitioned model consumes it. `m` is the micro-batch's index in the
global batch, so a replica of a data-parallel layout draws what single-process training draws
for the same samples. The stream's state at the start of each (sub-model, micro-batch) forward
is recorded and restored for its recomputation; where the model is cut between processes
(pipeline stages), the state travels with the activations (`StepRng.state` / `resume`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["RNG_VALUE", "StepRng", "micro_batch_rng", "micro_batch_seed"]

# the name under which a stage sends the generator states along with its activations
RNG_VALUE = "atomc.rng_state"


def micro_batch_seed(seed: int, step: int, micro_batch: int) -> int:
    """The seed of micro-batch `micro_batch` of step `step` (the same on every device)."""
    digest = hashlib.blake2b(f"atomc:{seed}:{step}:{micro_batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def generators(device: torch.device) -> list[torch.Generator]:
    gens = [torch.default_generator]
    if device.type == "cuda":
        torch.cuda.init()  # default_generators is filled in by CUDA's lazy initialisation
        gens.append(torch.cuda.default_generators[device.index if device.index is not None
                                                  else torch.cuda.current_device()])
    return gens


@contextmanager
def micro_batch_rng(seed: int, step: int, micro_batch: int,
                    device: str | torch.device = "cpu") -> Iterator[None]:
    """Run the block with the CPU (and CUDA) generators seeded for (step, micro_batch).

    This is the rule the runtimes follow; wrap the plain model's forward (and loss) of
    micro-batch m of step s in it to draw the same dropout masks. The caller's generator
    states are restored on exit.
    """
    gens = generators(torch.device(device))
    saved = [g.get_state() for g in gens]
    s = micro_batch_seed(seed, step, micro_batch)
    for g in gens:
        g.manual_seed(s)
    try:
        yield
    finally:
        for g, st in zip(gens, saved):
            g.set_state(st)


class StepRng:
    """Per-micro-batch generator cursors for one step; `first` is the global index of local
    micro-batch 0. The caller's generator states come back with `restore`."""

    def __init__(self, device: torch.device, seed: int, step: int, num_micro: int, first: int = 0):
        self.gens = generators(device)
        self.saved = [g.get_state() for g in self.gens]
        self.cursor: list[list[torch.Tensor]] = []
        for m in range(num_micro):
            s = micro_batch_seed(seed, step, first + m)
            states = []
            for g in self.gens:
                g.manual_seed(s)
                states.append(g.get_state())
            self.cursor.append(states)

    @contextmanager
    def forward(self, m: int) -> Iterator[list[torch.Tensor]]:
        """Continue micro-batch m's stream; yields the state it started from (for replay)."""
        start = self.cursor[m]
        for g, st in zip(self.gens, start):
            g.set_state(st)
        yield start
        self.cursor[m] = [g.get_state() for g in self.gens]

    @contextmanager
    def replay(self, state: list[torch.Tensor]) -> Iterator[None]:
        for g, st in zip(self.gens, state):
            g.set_state(st)
        yield

    def state(self, m: int) -> torch.Tensor:
        """Micro-batch m's stream where it stands, as one byte tensor (sent to the next stage)."""
        return torch.cat([s.reshape(-1) for s in self.cursor[m]])

    def resume(self, m: int, packed: torch.Tensor) -> None:
        """Continue micro-batch m from the state a previous stage sent (`state`)."""
        packed = packed.detach().to("cpu", torch.uint8)
        out, off = [], 0
        for st in self.cursor[m]:
            n = st.numel()
            out.append(packed[off:off + n].clone())
            off += n
        if off != packed.numel():
            raise ValueError(f"an RNG state of {packed.numel()} bytes arrived, {off} expected: "
                             f"the stages run on different device types")
        self.cursor[m] = out

    def restore(self) -> None:
        for g, st in zip(self.gens, self.saved):
            g.set_state(st)
