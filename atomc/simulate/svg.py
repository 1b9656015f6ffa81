"""Timeline -> SVG (like ATOM Fig. 12): one row per lane, one bar per event, dashed step lines.

Geometry is computed here; `templates/timeline.svg.jinja` only places it. Every bar carries a
<title> naming its sub-model, so bars too narrow for a label still say what they are.
"""

from __future__ import annotations

import importlib.resources
import math
from pathlib import Path
from typing import TYPE_CHECKING

from atomc.jsonio import write_atomic
from atomc.simulate.events import LANES, Timeline

if TYPE_CHECKING:
    import jinja2

LANE_TITLES = {"compute": "GPU compute", "prefetch": "host to device", "offload": "device to host",
               "optimizer": "CPU optimizer", "disk": "disk"}
KIND_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2b", "load": "#59a14f",
                "checkpoint": "#8cd17d", "offload": "#b07aa1", "optimizer": "#9c755f",
                "refresh": "#76b7b2", "activation_out": "#e15759", "state_read": "#edc948",
                "state_write": "#ff9da7", "image_read": "#bab0ac"}
WIDTH_PX = 1200
LEFT_PX = 130
RIGHT_PX = 40
TOP_PX = 48
LANE_PX = 34
GAP_PX = 10
CHAR_PX = 6.5  # label width per character at font-size 11


def _template() -> jinja2.Template:
    # imported here: `atomc partition` imports this module and draws only with --timeline, and
    # jinja2 is a tenth of its start-up
    import jinja2

    text = importlib.resources.files("atomc.templates").joinpath("timeline.svg.jinja").read_text()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=True,
                             trim_blocks=True, lstrip_blocks=True)
    return env.from_string(text)


def _nice_step(span: float, target: int = 10) -> float:
    raw = span / target if span > 0 else 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _fmt_ms(ms: float) -> str:
    return f"{ms / 1000:g} s" if ms >= 1000 else f"{ms:g} ms"


def _span_ms(timeline: Timeline) -> float:
    t0 = timeline.step_starts_ms[0]
    t1 = max([timeline.step_starts_ms[-1], *(e.end_ms for e in timeline.events)])
    return max(t1 - t0, 1e-9)


def render_timeline_svg(timeline: Timeline, title: str | None = None,
                        span_ms: float | None = None) -> str:
    """One timeline as an SVG document; `span_ms` fixes the time axis's length (default: the
    timeline's own), so that timelines drawn one above the other share a scale."""
    t0 = timeline.step_starts_ms[0]
    span = span_ms if span_ms is not None else _span_ms(timeline)
    plot_px = WIDTH_PX - LEFT_PX - RIGHT_PX
    scale = plot_px / span

    def x(ms: float) -> float:
        return round(LEFT_PX + (ms - t0) * scale, 2)

    lanes = [lane for lane in LANES if any(e.lane == lane for e in timeline.events)]
    rows = []
    for r, lane in enumerate(lanes):
        y = TOP_PX + r * (LANE_PX + GAP_PX)
        bars = []
        for e in timeline.lane_events(lane):
            x0, x1 = x(e.start_ms), x(e.end_ms)
            w = max(x1 - x0, 0.5)
            label = str(e.submodel)
            bars.append({
                "x": x0, "width": round(w, 2), "colour": KIND_COLOURS.get(e.kind, "#bab0ac"),
                "submodel": e.submodel, "kind": e.kind, "step": e.step,
                "tooltip": (f"sub-model {e.submodel} {e.kind} (step {e.step + 1}): "
                            f"{_fmt_ms(round(e.start_ms - t0, 3))} to "
                            f"{_fmt_ms(round(e.end_ms - t0, 3))}"),
                "label": label if w >= CHAR_PX * len(label) + 4 else "",
                "label_x": round(x0 + w / 2, 2),
            })
        rows.append({"title": LANE_TITLES.get(lane, lane), "lane": lane, "y": y, "bars": bars})
    height = TOP_PX + len(lanes) * (LANE_PX + GAP_PX) + 50
    tick = _nice_step(span)
    ticks = [{"x": x(t0 + i * tick), "label": _fmt_ms(round(i * tick, 6))}
             for i in range(int(span / tick) + 1)]
    steps = [{"x": x(s), "label": f"step {i + 1}" if i < timeline.num_steps else "end"}
             for i, s in enumerate(timeline.step_starts_ms)]
    legend = [{"kind": k, "colour": c, "x": LEFT_PX + i * 110}
              for i, c in enumerate(KIND_COLOURS.values()) for k in [list(KIND_COLOURS)[i]]]
    step_text = ", ".join(dict.fromkeys(_fmt_ms(round(timeline.step_ms(i), 3))
                                        for i in range(timeline.num_steps)))
    return _template().render(
        width=WIDTH_PX, height=height, left=LEFT_PX, right=WIDTH_PX - RIGHT_PX,
        lane_height=LANE_PX, rows=rows, ticks=ticks, steps=steps, legend=legend,
        axis_y=TOP_PX + len(lanes) * (LANE_PX + GAP_PX), top=TOP_PX - 14,
        title=title or timeline.label or f"{timeline.source} timeline",
        subtitle=(f"{timeline.source}: {timeline.num_submodels} sub-models, C={timeline.accum}, "
                  f"step {step_text}, GPU busy {timeline.utilisation():.1%}"),
    )


def write_timeline_svg(timeline: Timeline, path: str | Path, title: str | None = None) -> Path:
    return write_atomic(path, render_timeline_svg(timeline, title))


def render_timelines_svg(timelines: list[Timeline], titles: list[str | None] | None = None) -> str:
    """Timelines one above the other on one time scale (a measured step beside its prediction):
    one SVG document holding each timeline's drawing as a nested <svg>."""
    if not timelines:
        raise ValueError("no timelines to draw")
    titles = titles or [None] * len(timelines)
    span = max(_span_ms(t) for t in timelines)
    panels, y = [], 0
    for timeline, title in zip(timelines, titles):
        body = render_timeline_svg(timeline, title, span_ms=span)
        body = body.split("\n", 1)[1] if body.startswith("<?xml") else body
        height = int(body.split('height="', 1)[1].split('"', 1)[0])
        panels.append(body.replace("<svg ", f'<svg x="0" y="{y}" ', 1))
        y += height
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX}" height="{y}" '
            f'viewBox="0 0 {WIDTH_PX} {y}">\n' + "".join(panels) + "</svg>\n")


def write_timelines_svg(timelines: list[Timeline], path: str | Path,
                        titles: list[str | None] | None = None) -> Path:
    return write_atomic(path, render_timelines_svg(timelines, titles))
