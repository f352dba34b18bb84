"""The plan as an HTML page people open: per-rank memory bars by kind, then the tables.

The page stands alone (inline SVG and CSS, no scripts, nothing fetched), so it can be mailed
or attached to an issue. Ranks that share a role (same pp rank) share a plan, so the bars and
the table show one row per role, as to_text() does; a world of 16,384 ranks stays a page of a
few rows.
"""
from __future__ import annotations

import html
from typing import Any, List, Sequence

from graphpar.planner.drawing import bars_svg

# Memory kinds in the order the bars stack them: device memory first, then host memory
# (offloaded optimizer states and masters, host tables), which is not on the device.
MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "gathered", "host")
MEMORY_COLOURS = {"params": "#1f56a0", "grads": "#5b9bd5", "optimizer": "#e8a33d",
                  "activations": "#70ad47", "gathered": "#9e480e", "host": "#a5a5a5"}
_STYLE = ("body{font-family:sans-serif;margin:24px;color:#141414}table{border-collapse:collapse;margin:8px 0 20px}"
          "td,th{border:1px solid #ccc;padding:3px 8px}td.n{text-align:right}th{background:#f2f2f2}")


def mib(n: int) -> str:
    """Bytes as MiB with two decimals, the unit left to the caller (a column header, a suffix)."""
    return f"{n / 2**20:.2f}"


def memory_rows(ranks: Sequence[Any]) -> List[tuple]:
    """(label, {kind: bytes}) per rank plan, for the bars."""
    return [(f"rank {r.rank} (pp {r.pp_rank})",
             {"params": r.param_bytes, "grads": r.grad_bytes, "optimizer": r.optimizer_bytes,
              "activations": r.activation_peak_bytes, "gathered": r.gathered_bytes, "host": r.host_bytes})
            for r in ranks]


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[bool]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td{' class=n' if n else ''}>{html.escape(str(v))}</td>"
                                    for v, n in zip(row, numeric)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def plan_html(report: Any) -> str:
    """The whole page for a graphpar.plan Report."""
    strategy, ranks = report.strategy, report.distinct_ranks()
    title = (f"graphpar plan: world {report.world_size}, dp={strategy['dp']} tp={strategy['tp']} pp={strategy['pp']}, "
             f"microbatches={strategy['microbatches']}, schedule {strategy['schedule']}; "
             f"bubble {report.bubble_fraction:.1%}")
    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>graphpar plan</title><style>{_STYLE}</style>"
             f"</head><body><h1>{html.escape(title)}</h1>",
             bars_svg(memory_rows(ranks), MEMORY_KINDS, MEMORY_COLOURS, "memory per rank (one row per role)"),
             "<h2>Per rank (MiB)</h2>",
             _table(["rank", "dp tp pp", "params", "grads", "optimizer", "activations", "gathered (zero=3)",
                     "device total", "host", "transfers/step"],
                    [(r.rank, f"{r.dp_rank} {r.tp_rank} {r.pp_rank}", mib(r.param_bytes), mib(r.grad_bytes),
                      mib(r.optimizer_bytes), mib(r.activation_peak_bytes), mib(r.gathered_bytes),
                      mib(r.total_bytes), mib(r.host_bytes), mib(r.transfer_bytes)) for r in ranks],
                    [True, False] + [True] * 8)]
    if len(ranks) < len(report.ranks):
        parts.append("<p>One row per pipeline rank: ranks with the same pp rank have the same plan.</p>")
    parts += ["<h2>Transfers per step of rank 0</h2>",
              _table(["op", "axis", "calls", "MiB", "what"],
                     [(t.op, t.axis, t.count, mib(t.bytes), t.what) for t in report.ranks[0].collectives],
                     [False, False, True, True, False])]
    if report.fallbacks:
        parts += ["<h2>Layers left replicated (no sharding rule)</h2>",
                  _table(["module", "op", "reason"], [(m or "<top>", n, why) for n, m, why in report.fallbacks],
                         [False] * 3)]
    if report.replicated_linears:
        parts += ["<h2>Linears left whole (replicated)</h2>",
                  _table(["module", "reason"], report.replicated_linears, [False, False])]
    if report.partition:
        parts.append(f"<h2>Pipeline partition</h2><pre>{html.escape(report.partition)}</pre>")
    parts.append("</body></html>\n")
    return "".join(parts)
