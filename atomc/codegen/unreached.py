"""The parameters a traced model's output does not depend on: the sub-models hold them with
requires_grad=False (atomc.codegen.statements), as the model's own backward leaves them
without a gradient.
"""

from __future__ import annotations

import operator

from torch import fx

from atomc.profile.ops import is_inplace
from atomc.trace import TracedModel


def params_without_gradient(traced: TracedModel) -> frozenset[str]:
    """FQNs of the parameters from which no path of the graph reaches its output (code whose
    result nothing uses: CANINE's character-level head in a sequence classifier). The model's
    own backward leaves their .grad None, so torch's optimizers skip them, weight decay
    included; the sub-models hold them with requires_grad=False, which the runtime's optimizer
    skips alike (a gradient of zeros would decay them)."""
    gm = traced.gm
    cached = gm.meta.get("atomc_unreached")
    if cached is not None:
        return cached
    canon: dict[int, str] = {}
    for fqn, p in traced.model.named_parameters(remove_duplicate=False):
        canon.setdefault(id(p), fqn)
    # what the output depends on, and every write (an in-place op or item assignment whose
    # result is unused writes a value that is: `h[:, 0] = self.cls_token`, `h.add_(bias)`)
    live: set[fx.Node] = set()
    # (fx's `is_impure` would also count a dead dropout, whose random draw writes nothing)
    todo = [n for n in gm.graph.nodes
            if n.op == "output" or is_inplace(n) or n.target is operator.setitem]
    while todo:
        n = todo.pop()
        if n not in live:
            live.add(n)
            todo.extend(n.all_input_nodes)
    modules = dict(gm.named_modules())
    reached: set[str] = set()
    for n in live:
        if n.op == "get_attr":
            reached.add(canon.get(id(operator.attrgetter(str(n.target))(gm)), ""))
        elif n.op == "call_module":
            reached.update(canon.get(id(p), "") for _, p in
                           modules[str(n.target)].named_parameters(remove_duplicate=False))
    found = frozenset(f for f in canon.values() if f not in reached)
    gm.meta["atomc_unreached"] = found
    return found


__all__ = ["params_without_gradient"]
