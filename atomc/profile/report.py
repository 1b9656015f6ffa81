"""Text summary of a Profile: totals, heaviest operators, per-block totals."""

from __future__ import annotations

from collections import defaultdict

from atomc.ir import NodeCost, OpNode, Profile
from atomc.units import format_bytes, format_count, format_ms


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _op_row(op: OpNode, c: NodeCost) -> list[str]:
    return [op.name, op.module_type or op.target.rsplit(".", 1)[-1], format_bytes(c.param_bytes),
            format_bytes(max(c.peak_fwd_bytes, c.peak_bwd_bytes)), format_ms(c.fwd_ms),
            format_ms(c.bwd_ms)]


def summarise(profile: Profile, top: int = 8) -> str:
    g = profile.graph
    t = profile.totals()
    pairs = list(zip(g.nodes, profile.costs))
    num_compute = sum(1 for op, _ in pairs
                      if op.op in ("call_module", "call_function", "call_method"))
    lines = [
        f"model     {g.model_path} (config {g.config or '-'}, batch {g.batch_size}"
        + "".join(f", {k} {v}" for k, v in g.options.items()) + f"), frontend {g.frontend}",
        (f"profile   {profile.mode} on {profile.device}; H2D {profile.h2d_gbps:.1f} GB/s, "
         f"D2H {profile.d2h_gbps:.1f} GB/s"),
        (f"operators {len(g.nodes)} nodes, {num_compute} operators: {profile.num_unique} "
         f"{profile.mode}, {profile.num_reused} reused from an equal signature"),
        f"params    {format_count(g.num_params())} ({format_bytes(t['param_bytes'])}, "
        f"tied counted once" + (f"; {len(g.aliases)} tied" if g.aliases else "") + ")",
        (f"per step  forward {format_ms(t['fwd_ms'])}, backward {format_ms(t['bwd_ms'])}, "
         f"load all {format_ms(t['load_ms'])}; {format_count(t['fwd_flops'])}FLOP fwd, "
         f"{format_count(t['bwd_flops'])}FLOP bwd"),
        (f"memory    activations {format_bytes(t['output_bytes'])}, saved for backward "
         f"{format_bytes(t['saved_bytes'])}"),
        "",
    ]
    headers = ["operator", "kind", "params", "peak", "fwd", "bwd"]
    by_mem = sorted(pairs, key=lambda p: -(p[1].param_bytes
                                           + max(p[1].peak_fwd_bytes, p[1].peak_bwd_bytes)))
    by_time = sorted(pairs, key=lambda p: -(p[1].fwd_ms + p[1].bwd_ms))
    lines += ["heaviest by memory", _table(headers, [_op_row(o, c) for o, c in by_mem[:top]]), ""]
    lines += ["heaviest by time", _table(headers, [_op_row(o, c) for o, c in by_time[:top]]), ""]

    groups: dict[str, list[NodeCost]] = defaultdict(list)
    for op, c in pairs:
        groups[op.block or "(outside blocks)"].append(c)
    rows = []
    for name, cs in groups.items():
        rows.append([name, str(len(cs)), format_bytes(sum(c.param_bytes for c in cs)),
                     format_bytes(sum(c.saved_bytes for c in cs)),
                     format_ms(sum(c.fwd_ms for c in cs)), format_ms(sum(c.bwd_ms for c in cs)),
                     format_ms(sum(c.load_ms for c in cs))])
    if len(rows) > 12:  # long stacks: first, last and the rest folded
        rows = rows[:6] + [["...", "", "", "", "", "", ""]] + rows[-5:]
    lines += ["per block", _table(["block", "ops", "params", "saved", "fwd", "bwd", "load"], rows)]
    return "\n".join(lines)
