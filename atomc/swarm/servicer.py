"""SWARM server's p2p RPC handlers (hivemind `ServicerBase`): forward and backward calls, a
step's gradient sums for the stage's groupmates, and the stage's state for a server that joins,
moves or fell behind. The handlers move bytes; the server's parts they are given do the work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

# hivemind recognises streaming handlers by typing's AsyncIterator, not collections.abc's
from typing import Any, AsyncIterator  # noqa: UP035

from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from atomc.swarm.wire import refusal, split


class SwarmServicer(ServicerBase):
    """The p2p handlers. `answer(kind, requests)`: the response to a forward or backward call
    (atomc.swarm.calls); `contribution(step)`: our sums for a step, in parts
    (atomc.swarm.commit); `state_message(stage)`: the stage's state (atomc.swarm.state)."""

    def __init__(self, answer: Callable[[str, Any], Awaitable[Any]],
                 contribution: Callable[[int], list[Any]], state_message: Callable[[int], Any]):
        self.answer, self.contribution, self.state_message = answer, contribution, state_message

    # forward and backward stream both ways: a stage's activations outgrow one p2p message
    async def rpc_forward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                          context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in split(await self.answer("forward", requests)):
            yield part

    async def rpc_backward(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                           context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for part in split(await self.answer("backward", requests)):
            yield part

    async def rpc_contribution(self, request: runtime_pb2.ExpertUID,
                               context: P2PContext) -> AsyncIterator[runtime_pb2.Tensor]:
        for part in self.contribution(int(request.uid)):
            yield part

    async def rpc_state(self, request: runtime_pb2.ExpertUID,
                        context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The stage's state for a server that joins it, moves to it or fell behind; a
        refusal, in the server's words, when it does not hold that stage's state now."""
        try:
            msg = await asyncio.get_running_loop().run_in_executor(
                None, self.state_message, int(request.uid))
        except Exception as e:  # noqa: BLE001 - told to the caller, who asks another server
            msg = refusal(e, held=False)
        for part in split(msg):
            yield part


__all__ = ["SwarmServicer"]
