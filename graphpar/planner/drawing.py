"""Pictures people open in a browser: pipeline timelines and per-rank memory bars, as SVG.

SVG is built with xml.etree.ElementTree (escaping, well-formed output) and needs no plotting
dependency, so `graphpar demo` and the plan's HTML report draw on any machine; the same
markup is written to `.svg` files and inlined into HTML pages.

Timeline: one row per pipeline rank, a time axis with ticks, one box per compute
instruction coloured by kind (forward, backward, weight gradient), the microbatch number in
the box where it fits and the instruction in the box's tooltip.
"""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from typing import Iterable, Mapping, Sequence, Tuple

# Compute kinds and their colours; the legend lists the kinds a picture contains.
KIND_COLOURS = {"forward": "#add8e6", "backward": "#1f56a0", "backward_weight": "#e8a33d"}
KIND_LABELS = {"forward": "forward", "backward": "backward", "backward_weight": "weight gradient"}
_TEXT_ON = {"forward": "#141414", "backward": "#ffffff", "backward_weight": "#141414"}

_LEFT, _RIGHT, _TOP, _ROW_H, _BOX_H, _AXIS_H, _LEGEND_H = 90, 20, 34, 28, 20, 34, 24
_WIDTH = 1000      # drawing area in px, whatever the time span
_CHAR_W = 7        # px per character at font-size 11: decides whether a label fits its box


def _svg(width: float, height: float) -> ET.Element:
    return ET.Element("svg", xmlns="http://www.w3.org/2000/svg", width=f"{width:.0f}", height=f"{height:.0f}",
                      viewBox=f"0 0 {width:.0f} {height:.0f}", **{"font-family": "sans-serif", "font-size": "11"})


def _text(parent: ET.Element, x: float, y: float, text: str, **attrs) -> ET.Element:
    element = ET.SubElement(parent, "text", x=f"{x:.1f}", y=f"{y:.1f}", **attrs)
    element.text = text
    return element


def nice_ticks(span: float, target: int = 8) -> list[float]:
    """Tick positions 0, step, 2*step, ... covering [0, span] with a 1/2/5 x 10^k step."""
    if span <= 0:
        return [0.0]
    raw = span / target
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def _frame(rows: int, title: str) -> Tuple[ET.Element, float, float]:
    """An SVG with a title and room for `rows` rows, an axis and a legend: (svg, axis y, legend y)."""
    height = _TOP + rows * _ROW_H + _AXIS_H + _LEGEND_H
    svg = _svg(_LEFT + _WIDTH + _RIGHT, height)
    _text(svg, _LEFT, 20, title, **{"font-size": "14", "class": "title"})
    return svg, _TOP + rows * _ROW_H, height - 8


def _axis(svg: ET.Element, span: float, px_per_unit: float, axis_y: float, suffix: str, caption: str) -> None:
    """Grid lines and tick labels from 0 to `span` (in axis units), and the axis caption."""
    for tick in nice_ticks(span):
        x = _LEFT + tick * px_per_unit
        ET.SubElement(svg, "line", x1=f"{x:.1f}", x2=f"{x:.1f}", y1=f"{_TOP}", y2=f"{axis_y + 4}",
                      stroke="#e1e1e1", **{"class": "tick"})
        _text(svg, x, axis_y + 16, f"{tick:g}{suffix}", **{"text-anchor": "middle"})
    _text(svg, _LEFT + _WIDTH / 2, axis_y + 30, caption, **{"text-anchor": "middle"})


def _legend(svg: ET.Element, entries: Iterable[Tuple[str, str, str]], y: float) -> None:
    """One swatch and label per (css class, colour, label)."""
    x = _LEFT
    for css, colour, label in entries:
        ET.SubElement(svg, "rect", x=f"{x}", y=f"{y - 10}", width="14", height="12", fill=colour,
                      stroke="#141414", **{"class": f"legend {css}"})
        _text(svg, x + 19, y, label)
        x += 30 + _CHAR_W * len(label)


def _row_label(svg: ET.Element, index: int, label: str) -> float:
    """Writes a row's label; returns the y of the row's boxes."""
    y = _TOP + index * _ROW_H + (_ROW_H - _BOX_H) / 2
    _text(svg, 8, y + _BOX_H * 0.7, label)
    return y


def timeline_svg(order: Sequence[Sequence[Tuple[float, float, object]]], title: str, unit: str = "") -> str:
    """SVG of per-rank (start, end, instruction) rows; instructions have .op, .mb and .stage.

    `unit` is appended to tick labels ("s" for measured seconds, "" for schedule units)."""
    span = max((end for rows in order for _, end, _ in rows), default=0.0) or 1.0
    scale = _WIDTH / span
    svg, axis_y, legend_y = _frame(len(order), title)
    _axis(svg, span, scale, axis_y, unit, f"time ({unit})" if unit else "time")
    kinds = set()
    for rank, rows in enumerate(order):
        y = _row_label(svg, rank, f"pp rank {rank}")
        group = ET.SubElement(svg, "g", **{"class": f"rank rank-{rank}"})
        for start, end, ins in rows:
            kinds.add(ins.op)
            _box(group, _LEFT + start * scale, max((end - start) * scale, 1.0), y, ins, start, end, unit)
    _legend(svg, [(k, KIND_COLOURS[k], KIND_LABELS[k]) for k in KIND_COLOURS if k in kinds], legend_y)
    return ET.tostring(svg, encoding="unicode")


def _box(group: ET.Element, x: float, width: float, y: float, ins, start: float, end: float, unit: str) -> None:
    rect = ET.SubElement(group, "rect", x=f"{x:.2f}", y=f"{y:.1f}", width=f"{width:.2f}", height=f"{_BOX_H}",
                         fill=KIND_COLOURS[ins.op], stroke="#141414", **{"stroke-width": "0.5", "class": ins.op})
    ET.SubElement(rect, "title").text = (f"{KIND_LABELS[ins.op]}, microbatch {ins.mb}, stage {ins.stage}: "
                                         f"{start:g}{unit} to {end:g}{unit}")
    label = str(ins.mb)
    if _CHAR_W * len(label) + 4 <= width:
        _text(group, x + width / 2, y + _BOX_H * 0.7, label, fill=_TEXT_ON[ins.op], **{"text-anchor": "middle"})


def bars_svg(rows: Sequence[Tuple[str, Mapping[str, float]]], kinds: Sequence[str], colours: Mapping[str, str],
             title: str, unit_label: str = "MiB", unit: float = 2 ** 20) -> str:
    """Horizontal stacked bars: one row per (label, {kind: value}), segments in `kinds` order."""
    peak = max((sum(values.get(k, 0.0) for k in kinds) for _, values in rows), default=0.0) or 1.0
    scale = _WIDTH / peak
    svg, axis_y, legend_y = _frame(len(rows), title)
    _axis(svg, peak / unit, unit * scale, axis_y, "", unit_label)
    for index, (label, values) in enumerate(rows):
        y = _row_label(svg, index, label)
        x = _LEFT
        for kind in kinds:
            width = values.get(kind, 0.0) * scale
            if width > 0:
                rect = ET.SubElement(svg, "rect", x=f"{x:.2f}", y=f"{y:.1f}", width=f"{width:.2f}",
                                     height=f"{_BOX_H}", fill=colours[kind], **{"class": kind})
                ET.SubElement(rect, "title").text = f"{label}: {kind} {values[kind] / unit:.3g} {unit_label}"
                x += width
    present = [k for k in kinds if any(values.get(k, 0.0) > 0 for _, values in rows)]
    _legend(svg, [(k, colours[k], k) for k in present], legend_y)
    return ET.tostring(svg, encoding="unicode")
