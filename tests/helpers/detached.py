"""Generated sub-models run as the runtimes run them: each on fresh autograd leaves of the values
it receives (detached at every cut), a leaf taking a gradient exactly when the package's
BOUNDARIES say so at that cut, and the gradients handed back by value name, one sub-model's
backward at a time. One autograd graph over all sub-models would hide a wrong boundary flag:
autograd itself carries the gradient across the cut there.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from atomc.runtime.interpret import boundary_leaf
from atomc.runtime.package import load_swap_package


def run_detached(package: ModuleType | Path, subs: list[torch.nn.Module], inputs: tuple,
                 loss_fn: Any) -> tuple[Any, torch.Tensor]:
    """(the last sub-model's outputs, the loss) of one forward and backward of `subs` on the
    model inputs `inputs`; every parameter's gradient accumulates in `subs`, as the swap
    executor's F and B actions leave them."""
    path = Path(package.__file__).parent if isinstance(package, ModuleType) else Path(package)
    pkg = load_swap_package(path)
    computed = {n for n, p in pkg.producers().items() if p >= 0}
    env: dict[str, Any] = dict(zip(pkg.model_inputs, inputs))
    taken: list[list[Any]] = []
    given: list[tuple] = []
    for i, sub in enumerate(subs):
        args = [boundary_leaf(env[n], n in computed and pkg.carries_grad(n, i))
                for n in pkg.inputs[i]]
        taken.append(args)
        out = sub(*args)
        if i < len(subs) - 1:
            outs = out if isinstance(out, tuple) else (out,)
            given.append(outs)
            env.update((n, v.detach() if isinstance(v, torch.Tensor) else v)
                       for n, v in zip(pkg.outputs[i], outs))
    loss = loss_fn(out, inputs)
    loss.backward()
    grads: dict[str, torch.Tensor] = {}
    _collect(grads, pkg.inputs[-1], taken[-1])
    for i in range(len(subs) - 2, -1, -1):
        pairs = [(o, grads.pop(n)) for n, o in zip(pkg.outputs[i], given[i])
                 if n in grads and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        _collect(grads, pkg.inputs[i], taken[i])
    return out, loss


def _collect(grads: dict[str, torch.Tensor], names: tuple[str, ...], args: list[Any]) -> None:
    for n, a in zip(names, args):
        if isinstance(a, torch.Tensor) and a.grad is not None:
            grads[n] = a.grad if n not in grads else grads[n] + a.grad
