"""Synthetic profiles for partition and simulation tests: no tracing, no torch.

`block_profile` builds a GPT-like chain (input, tied embedding, repeated blocks with residual
edges, a head reading the embedding's weight again, output) with chosen per-node costs;
`random_profile` builds a small random graph in topological order with residual edges, shared
parameters and random costs, for property tests against brute force.
"""

from __future__ import annotations

import random

from atomc.ir import NodeCost, OpGraph, OpNode, Profile, TensorSpec

MB = 1_000_000


def _spec(num_bytes: int, shape=None) -> TensorSpec:
    return TensorSpec(shape or (max(num_bytes // 4, 1),), "float32", num_bytes)


def _node(name, op, inputs, out_bytes, params=(), block="", signature=None, module=""):
    outputs = () if out_bytes is None else (_spec(out_bytes),)
    return OpNode(name=name, op=op, target=name, module_fqn=module, module_type="Synthetic",
                  block=block, inputs=tuple(inputs), outputs=outputs, param_fqns=tuple(params),
                  buffer_fqns=(), signature=signature or name)


def _cost(name, *, params=0, out=0, saved=0, fwd_ms=0.0, bwd_ms=0.0, peak_extra=0) -> NodeCost:
    return NodeCost(name=name, param_bytes=params, output_bytes=out, saved_bytes=saved,
                    peak_fwd_bytes=params + out + peak_extra,
                    peak_bwd_bytes=2 * params + out + peak_extra,
                    fwd_ms=fwd_ms, bwd_ms=bwd_ms, load_ms=0.0, fwd_flops=int(fwd_ms * 1e9),
                    bwd_flops=int(bwd_ms * 1e9), source="estimated")


def make_profile(nodes, costs, params: dict[str, int], blocks=(), h2d_gbps=10.0,
                 d2h_gbps=10.0) -> Profile:
    graph = OpGraph(model_path="synthetic.py", config="synthetic", batch_size=1, options={},
                    frontend="fx", dtype="float32", nodes=tuple(nodes),
                    params={k: _spec(v) for k, v in params.items()}, buffers={}, aliases={},
                    blocks=tuple(blocks))
    return Profile(graph=graph, costs=tuple(costs), mode="estimated", device="synthetic",
                   hardware=None, h2d_gbps=h2d_gbps, d2h_gbps=d2h_gbps,
                   num_unique=len(nodes), num_reused=0)


def block_profile(num_blocks: int = 6, block=((4, 1.0, 2.0), (0, 0.5, 1.0), (8, 2.0, 4.0)),
                  act_bytes: int = 1 * MB, embed_bytes: int = 6 * MB, h2d_gbps: float = 10.0,
                  tied: bool = True, reads: bool = False) -> Profile:
    """A chain: input, embedding, `num_blocks` blocks of len(block) operators plus a residual
    add, a final operator and a head that reads the embedding's weight when `tied`.

    `block` lists (param MB, fwd ms, bwd ms) per operator of a block. With `reads`, a block's
    operators read their weights from parameter reads inside the block (get_attr nodes, whose
    signatures carry their names), as torch.export's graphs do.
    """
    nodes, costs, params = [], [], {}
    nodes.append(_node("idx", "placeholder", (), 8))
    costs.append(_cost("idx", out=8))
    params["wte.weight"] = embed_bytes
    nodes.append(_node("wte", "call_module", ("idx",), act_bytes, ("wte.weight",), module="wte"))
    costs.append(_cost("wte", params=embed_bytes, out=act_bytes, saved=8, fwd_ms=0.05, bwd_ms=0.1))
    prev = "wte"
    names = []
    for b in range(num_blocks):
        fqn = f"h.{b}"
        names.append(fqn)
        x = prev
        for j, (pmb, fwd, bwd) in enumerate(block):
            name = f"h_{b}_op{j}"
            pfqns, inputs, op_params = (), (x,), pmb * MB
            if pmb:
                pfqns = (f"{fqn}.op{j}.weight",)
                params[pfqns[0]] = pmb * MB
            if pmb and reads:
                read = f"{name}_weight"
                nodes.append(_node(read, "get_attr", (), pmb * MB, pfqns, block=fqn))
                costs.append(_cost(read, params=pmb * MB, out=pmb * MB))
                pfqns, inputs, op_params = (), (x, read), 0
            nodes.append(_node(name, "call_module", inputs, act_bytes, pfqns, block=fqn,
                               signature=f"op{j}", module=f"{fqn}.op{j}"))
            costs.append(_cost(name, params=op_params, out=act_bytes, saved=act_bytes,
                               fwd_ms=fwd, bwd_ms=bwd, peak_extra=act_bytes))
            x = name
        add = f"h_{b}_add"
        nodes.append(_node(add, "call_function", (prev, x), act_bytes, block=fqn, signature="add",
                           module=fqn))
        costs.append(_cost(add, out=act_bytes, fwd_ms=0.01, bwd_ms=0.01))
        prev = add
    params["ln_f.weight"] = 4096
    nodes.append(_node("ln_f", "call_module", (prev,), act_bytes, ("ln_f.weight",), module="ln_f"))
    costs.append(_cost("ln_f", params=4096, out=act_bytes, saved=act_bytes, fwd_ms=0.05,
                       bwd_ms=0.1))
    head_params = ("wte.weight",) if tied else ("lm_head.weight",)
    if not tied:
        params["lm_head.weight"] = embed_bytes
    nodes.append(_node("lm_head", "call_module", ("ln_f",), 2 * act_bytes, head_params,
                       module="lm_head"))
    costs.append(_cost("lm_head", params=0 if tied else embed_bytes, out=2 * act_bytes,
                       saved=act_bytes, fwd_ms=1.5, bwd_ms=3.0, peak_extra=act_bytes))
    nodes.append(_node("output", "output", ("lm_head",), None))
    costs.append(_cost("output"))
    return make_profile(nodes, costs, params, names, h2d_gbps=h2d_gbps, d2h_gbps=h2d_gbps)


def random_profile(rng: random.Random, num_nodes: int) -> Profile:
    """A random graph of `num_nodes` nodes (>= 3): a placeholder, operators each reading the
    previous node and sometimes an earlier one (residual edges), and an output node. Some
    parameters are read by two operators (tied weights)."""
    nodes, costs, params = [], [], {}
    nodes.append(_node("x", "placeholder", (), rng.randint(1, 4) * MB))
    costs.append(_cost("x", out=nodes[0].outputs[0].num_bytes))
    for i in range(1, num_nodes - 1):
        name = f"op{i}"
        inputs = [nodes[i - 1].name]
        if i > 1 and rng.random() < 0.35:
            extra = nodes[rng.randrange(0, i - 1)].name
            if extra not in inputs:
                inputs.append(extra)
        own = []
        if rng.random() < 0.6:
            fqn = f"w{i}"
            params[fqn] = rng.randint(1, 60) * MB
            own.append(fqn)
        if params and rng.random() < 0.2:  # read an earlier node's parameter again
            shared = rng.choice(sorted(params))
            if shared not in own:
                own.append(shared)
        pbytes = sum(params[f] for f in own)
        out = rng.choice([0, rng.randint(1, 8) * MB])
        fwd = rng.choice([0.0, round(rng.uniform(0.1, 6.0), 3)])
        nodes.append(_node(name, "call_function", inputs, out, tuple(own), module=f"m{i}"))
        costs.append(_cost(name, params=pbytes, out=out, saved=rng.randint(0, 4) * MB, fwd_ms=fwd,
                           bwd_ms=round(fwd * rng.uniform(1.0, 3.0), 3),
                           peak_extra=rng.randint(0, 4) * MB))
    nodes.append(_node("output", "output", (nodes[-1].name,), None))
    costs.append(_cost("output"))
    gbps = rng.choice([5.0, 10.0, 25.0])
    return make_profile(nodes, costs, params, h2d_gbps=gbps, d2h_gbps=rng.choice([gbps, 2 * gbps]))
