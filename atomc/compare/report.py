"""The comparison as text: one row per mode, then which is fastest and why."""

from __future__ import annotations

from atomc.compare import Comparison, describe_machines
from atomc.compare.modes import BASELINES, ModeResult
from atomc.units import format_bytes

LABELS = {"peers": "ATOM peers", "diloco": "DiLoCo peers", "gpipe": "layout, GPipe",
          "1f1b": "layout, 1F1B", "swarm": "SWARM",
          "pipedream": "PipeDream (baseline; atomc does not run it)"}


def _time(ns: int) -> str:
    s = ns / 1e9
    return f"{s:.3f} s" if s < 100 else f"{s:.0f} s"


def _traffic(r: ModeResult) -> str:
    total = sum(nb for _, _, nb, _ in r.links)
    return format_bytes(total) if total else "-"


def render(c: Comparison, links: int = 3) -> str:
    st = c.setting
    w = max([14] + [len(LABELS[m]) for m in c.results])
    lines = [
        f"compare on {c.network.name or 'network'}: {describe_machines(c.machines)}",
        (f"global batch {st.global_batch} samples"
         + ("" if st.sync else "; no averaging and no optimizer step (ATOM Fig. 14)")
         + (f"; peers at C={st.accum}" if st.accum else "")),
        "",
        (f"{'mode':<{w}} {'global batch':>12} {'samples/s':>10} {'busy min/mean/max':>18} "
         f"{'traffic':>11}  binding"),
    ]
    for mode, r in c.results.items():
        label = LABELS[mode]
        if not r.feasible:
            lines.append(f"{label:<{w}} {'-':>12} {'-':>10} {'-':>18} {'-':>11}  "
                         f"does not fit: {r.reason}")
            continue
        shares = [b for _, b in r.busy]
        rate = r.samples / r.step_s if r.step_ns else 0.0
        lines.append(f"{label:<{w}} {_time(r.step_ns):>12} {rate:>10.3g} "
                     f"{min(shares):>5.0%} /{r.mean_busy():>4.0%} /{max(shares):>4.0%}   "
                     f"{_traffic(r):>11}  {r.binding}")
        lines.append(f"{'':<{w}} {r.config}"
                     + (f"; {r.samples} samples a round" if r.samples != st.global_batch
                        else ""))
        for a, b, nb, s in r.links[:links]:
            lines.append(f"{'':<{w}} link {a} -> {b}: {format_bytes(nb)} per global batch, "
                         f"busy {s:.0%}")
        line = decentralized(r)
        if line:
            lines.append(f"{'':<{w}} {line}")
    lines.append("")
    lines.append(verdict(c))
    return "\n".join(lines)


def decentralized(r: ModeResult) -> str:
    """What decentralized runs report, for peers and DiLoCo: compute utilization (local steps'
    time over the wall time), the communication share, and the bytes sent per token against
    plain data parallelism's; '' for other modes."""
    d = r.detail
    if "bytes_per_token" not in d:
        return ""
    words = [f"compute utilization {d['utilization']:.0%}"]
    if "communication_share" in d:
        words.append(f"communication {d['communication_share']:.0%} of the wall time")
    unit = "token" if d.get("tokens_per_sample", 1) > 1 else "sample"
    words.append(f"{format_bytes(d['bytes_per_token'])} sent a {unit}")
    if d.get("dp_bytes_per_token"):
        words[-1] += (f", {d['vs_dp']:.2%} of data parallelism's "
                      f"({format_bytes(d['dp_bytes_per_token'])})")
    return "; ".join(words)


def verdict(c: Comparison) -> str:
    """Which mode is fastest and what binds it and the next one; a baseline atomc does not
    run is set beside the fastest, never named it."""
    fastest = c.fastest()
    baselines = [r for r in c.feasible() if r.mode in BASELINES]
    if fastest is None:
        return "no mode atomc runs fits these devices (see above)" + "".join(
            f"; {LABELS[r.mode]}: {_time(r.step_ns)}, bound by {r.binding}" for r in baselines)
    others = sorted((r for r in c.feasible() if r is not fastest and r.mode not in BASELINES),
                    key=lambda r: r.step_ns)
    text = (f"fastest: {LABELS[fastest.mode]}, {_time(fastest.step_ns)} per global batch; "
            f"it is bound by {fastest.binding}")
    if others:
        nxt = others[0]
        text += (f". Next: {LABELS[nxt.mode]}, {nxt.step_ns / fastest.step_ns:.2f}x slower, "
                 f"bound by {nxt.binding}")
    for r in baselines:
        text += (f". {LABELS[r.mode]}: {r.step_ns / fastest.step_ns:.2f}x the fastest's "
                 f"time, bound by {r.binding}")
    if "diloco" in c.results and c.results["diloco"].feasible:
        text += (". DiLoCo's outer step over H local steps reaches another loss than the other "
                 "modes' update every global batch: compare the losses too "
                 "(bench/RESULTS.md#diloco)")
    return text + "."


__all__ = ["LABELS", "decentralized", "render", "verdict"]
