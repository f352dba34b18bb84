"""What a calibration holds (graphpar/planner/calibrate.py measures it; the time model in
graphpar/planner/time_model.py reads it): a machine's throughput, links, overheads and speeds,
and how a transfer's bytes are counted."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

# what a rank sends of a buffer of n bytes over g ranks (ring algorithms; auto.sent_bytes's)
SENT_SHARE = {"all_reduce": lambda g: 2 * (g - 1) / g, "reduce_scatter": lambda g: (g - 1) / g,
              "all_gather": lambda g: (g - 1) / g, "all_to_all": lambda g: (g - 1) / g}


@dataclass
class Link:
    """A transfer costs alpha + sent / beta seconds."""
    alpha: float
    beta: float

    def time(self, sent: float, calls: float = 1.0) -> float:
        return self.alpha * calls + sent / self.beta


@dataclass
class Calibration:
    """What calibrate() measured; every field in seconds, bytes or flops per second."""
    key: Dict[str, Any]
    width: int
    matmul: Dict[int, List[Tuple[int, float]]]     # tp -> (rows, flops per second), rows ascending
    collectives: Dict[str, Dict[int, Link]]        # op -> group size -> link
    p2p: Link
    overlap: float                                 # share of a dp all-reduce that hides behind compute
    memory_bandwidth: float                        # bytes per second an optimizer step streams
    unit_overhead: float                           # seconds per pipeline unit per microbatch (fwd + bwd)
    microbatch_overhead: float                     # seconds per microbatch per stage (fwd + bwd)
    step_overhead: float                           # seconds per step, whatever its size
    unit_step_overhead: float = 0.0                # seconds per pipeline unit per step (its optimizer step, gradients)
    zero_overhead: Dict[int, float] = field(default_factory=dict)   # ZeRO stage -> seconds per unit per step
    speedup: Dict[int, float] = field(default_factory=dict)   # ranks computing at once -> speed against all of them
    busy_latency: Dict[int, float] = field(default_factory=dict)   # group size -> a small all-reduce between matmuls
    model_flops: Optional[float] = None            # the model's own forward and backward, 6 flops per parameter per token
    model_overhead: float = 0.0                    # seconds a microbatch more of the model takes beyond the other terms
    seconds: float = 0.0                           # how long the calibration took
    extra: Dict[str, Any] = field(default_factory=dict)

    def flops(self, rows: float, tp: int) -> float:
        """Compute throughput at `rows` rows (tokens) per microbatch: the model's own where it
        was calibrated with one (scaled by the matmuls' at tp against tp=1: narrower shards),
        else the matmuls'."""
        if self.model_flops is None:
            return self.matmul_flops(rows, tp)
        return self.model_flops * self.matmul_flops(rows, tp) / self.matmul_flops(rows, 1)

    def matmul_flops(self, rows: float, tp: int) -> float:
        """Matmul throughput at `rows` rows per call: linear in log(rows) between the sizes
        measured, the nearest end outside them."""
        table = self.matmul.get(tp) or self.matmul[min(self.matmul, key=lambda t: abs(t - tp))]
        if rows <= table[0][0]:
            return table[0][1]
        for (r0, f0), (r1, f1) in zip(table, table[1:]):
            if rows <= r1:
                w = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
                return f0 + w * (f1 - f0)
        return table[-1][1]

    def link(self, op: str, group: int) -> Link:
        """The link of a collective over `group` ranks (point-to-point and host ops: p2p); a
        group size not measured takes the nearest measured one of that op (all-reduce's
        where the op was not measured: gloo runs it where it has no reduce-scatter)."""
        table = self.collectives.get(op) or self.collectives.get("all_reduce")
        if op in ("send", "recv") or not table:
            return self.p2p
        return table.get(group) or table[min(table, key=lambda g: abs(g - group))]

    def busy_link(self, op: str, group: int) -> Link:
        """The link of a collective issued between computations (tp's, zero=3's, inside the
        ops): an all-reduce's latency the calibrated busy latency of its group size, what
        all-reduces between computations took (calibrate.tp_latency: at the model's tp step),
        lower than the tight loop's or not (4 ranks on 2 cores: the loop timed a 2-rank
        all-reduce at 1.5-3.2 ms in four calibrations, the models' tp steps at 1.0-1.7 ms);
        another op's the larger of its own link's and that (timed on all-reduces only)."""
        link = self.link(op, group)
        busy = _nearest(self.busy_latency, group)
        if busy is None:
            return link
        return Link(busy if op == "all_reduce" else max(link.alpha, busy), link.beta)

    def speed(self, busy_ranks: float) -> float:
        """Compute speed with `busy_ranks` ranks computing at once, against every rank at
        once: speed_in(the calibrated speedup)."""
        return speed_in(self.speedup, busy_ranks)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Calibration":
        d = json.loads(text)
        d["matmul"] = {int(tp): [tuple(row) for row in rows] for tp, rows in d["matmul"].items()}
        d["collectives"] = {op: {int(g): Link(**link) for g, link in by.items()} for op, by in d["collectives"].items()}
        d["p2p"] = Link(**d["p2p"])
        d["zero_overhead"] = {int(z): t for z, t in d["zero_overhead"].items()}
        d["speedup"] = {int(n): s for n, s in d["speedup"].items()}
        d["busy_latency"] = {int(g): t for g, t in d["busy_latency"].items()}
        return Calibration(**d)

    def to_text(self) -> str:
        lines = [f"calibration of {self.key['hostname']} ({self.key['cpu']}, {self.key['cores']} cores, torch "
                 f"{self.key['torch']}, {self.key['backend']}, world {self.key['world_size']}), "
                 f"{self.seconds:.1f} s",
                 "  matmul GFLOP/s (rows: " + ", ".join(str(r) for r, _ in next(iter(self.matmul.values()))) + "): "
                 + "; ".join(f"tp={tp} " + " ".join(f"{f / 1e9:.1f}" for _, f in rows)
                             for tp, rows in sorted(self.matmul.items()))]
        for op, by in sorted(self.collectives.items()):
            lines.append(f"  {op}: " + "; ".join(f"g={g} {link.alpha * 1e6:.0f} us + {link.beta / 1e9:.2f} GB/s"
                                                  for g, link in sorted(by.items())))
        if self.busy_latency:
            lines.append("  all_reduce between matmuls: " + "; ".join(f"g={g} {t * 1e6:.0f} us" for g, t
                                                                     in sorted(self.busy_latency.items())))
        if self.speedup:
            lines.append("  speed with n ranks computing: " + "; ".join(f"n={n} {s:.2f}x" for n, s
                                                                        in sorted(self.speedup.items())))
        lines += [f"  p2p: {self.p2p.alpha * 1e6:.0f} us + {self.p2p.beta / 1e9:.2f} GB/s; overlap {self.overlap:.2f}; "
                  f"memory {self.memory_bandwidth / 1e9:.2f} GB/s",
                  f"  overhead: {self.unit_overhead * 1e3:.3f} ms per unit per microbatch, "
                  f"{self.microbatch_overhead * 1e3:.3f} ms per microbatch per stage, "
                  f"{self.unit_step_overhead * 1e3:.3f} ms per unit per step, "
                  f"{self.step_overhead * 1e3:.3f} ms per step; ZeRO per unit per step: "
                  + ", ".join(f"zero={z} {t * 1e3:.3f} ms" for z, t in sorted(self.zero_overhead.items()))]
        if self.model_flops is not None:
            lines.append(f"  the model's forward and backward, as graphpar runs it: {self.model_flops / 1e9:.1f} GFLOP/s "
                         f"(6 per parameter per token), {self.model_overhead * 1e3:.3f} ms per microbatch more")
        return "\n".join(lines)


def speed_in(speedup: Dict[int, float], busy_ranks: float) -> float:
    """The speed with `busy_ranks` ranks computing at once in a speedup table (ranks
    computing -> speed against all of them; 1 where it is empty): linear between the counts
    measured, the nearest end outside them."""
    if not speedup:
        return 1.0
    table = sorted(speedup.items())
    if busy_ranks <= table[0][0]:
        return table[0][1]
    for (n0, s0), (n1, s1) in zip(table, table[1:]):
        if busy_ranks <= n1:
            return s0 + (busy_ranks - n0) / (n1 - n0) * (s1 - s0)
    return table[-1][1]


def _nearest(table: Dict[int, float], key: int) -> Optional[float]:
    """table[key], else the value at the nearest key measured; None for an empty table."""
    if not table:
        return None
    return table.get(key, table[min(table, key=lambda k: abs(k - key))])
