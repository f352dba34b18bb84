"""The automatic strategy's cost model against measured step times.

    .venv/bin/python benchmarks/bench_auto.py [--worlds 2,4] [--models gpt,llama] [--steps 5] [--warmup 2]
                                              [--passes 2] [--limit N] [--out FILE]
    .venv/bin/python benchmarks/bench_auto.py --rescore FILE [--rescore FILE ...] [--out FILE]

For each world size and model: calibrate this machine (graphpar.auto.calibrate with the
model and the optimizer, measured afresh), search every strategy
(graphpar.auto.search with that calibration, no memory budget), then run every legal
candidate on gloo, each in fresh processes (graphpar/planner/measure.py: `--warmup` steps, then
the median of `--steps`; a step's time is its slowest rank's). Reported per candidate: the
predicted and measured step time and the prediction's error relative to the measurement;
per model and world: the largest error, the Spearman rank correlation of the predicted and
measured orders, and whether the predicted winner is within 5% of the measured best. With
`--passes 2` (the default) every candidate is run a second time, in a launch of its own, and
the Spearman correlation of the two measured orders is reported beside: how well the
machine's own noise lets any prediction rank these candidates (other work on shared cores
moves step times by more than the candidates differ). `--limit N` runs only N legal
candidates, spread evenly over the predicted order from the predicted winner to the
predicted slowest (a quick look at the errors' direction; the winner is then compared with
the best of those N).

`--rescore FILE` runs nothing: it reads a report this script wrote (each model and world's
calibration is in it as JSON, and each candidate's measured time) and predicts the same
candidates again with the time model of this checkout and that calibration. Step times on
shared cores move by 10-40% between runs, so a change to the time model is judged against
several recorded runs at once, each with the calibration measured beside it, not against a
new run's noise.

Models (global batch 8 sequences of 64 tokens, AdamW):
    gpt     graphpar.models.gpt's GPT, 4 layers, n_embd 128, 4 heads, vocab 256
    llama   a random-init transformers LlamaForCausalLM: 4 layers, hidden 128, MLP 256, 4 heads
            (4 kv heads: tp up to 4 divides them), vocab 256 (the export front end)

Targets (issue 20): every error within 25%, Spearman >= 0.9, the winner within 5%.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time
from typing import Dict, List, Sequence

import _common
import torch
import torch.nn.functional as F

from graphpar.planner import auto
from graphpar.planner.calibrate import FORMAT, model_width
from graphpar.planner.calibration import Calibration
from graphpar.planner.measure import measure_steps
from graphpar.models.gpt import GPT, GPTConfig, lm_loss

BATCH, SEQ, VOCAB = 8, 64, 256
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3)
ERROR_TARGET, SPEARMAN_TARGET, WINNER_TARGET = 0.25, 0.9, 0.05


def llama_loss(output, target):
    """transformers returns a CausalLMOutputWithPast; its .logits is [batch, seq, vocab]."""
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def build(name: str):
    """(model, example_inputs, loss_fn, example_target): the global batch."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=128)), (x,), lm_loss, y
    import transformers   # in graphpar's test extra

    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                      max_position_embeddings=SEQ, use_cache=False, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    return transformers.LlamaForCausalLM(config), (x,), llama_loss, y


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        found = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                found[order[k]] = (i + j) / 2
            i = j + 1
        return found
    if len(a) < 2:
        return float("nan")
    return statistics.correlation(ranks(a), ranks(b))


def spread(ordered: List, limit: int) -> List:
    """`limit` items of `ordered` evenly spaced from its first to its last (all of them when
    there are no more than `limit`)."""
    if limit <= 0 or len(ordered) <= limit:
        return list(ordered)
    if limit == 1:
        return ordered[:1]
    return [ordered[round(i * (len(ordered) - 1) / (limit - 1))] for i in range(limit)]


def compare(name: str, world: int, steps: int, warmup: int, passes: int, limit: int = 0) -> Dict:
    model, inputs, loss_fn, target = build(name)
    start = time.perf_counter()
    # measured afresh (refresh): the comparison is of a calibration with the steps that follow
    # it, and its time is the calibration's own, not a cache read
    calibration = auto.calibrate(world, width=model_width(model), model=model, example_inputs=inputs, loss_fn=loss_fn,
                                 example_target=target, optimizer=OPTIMIZER, refresh=True)
    calibrated = time.perf_counter() - start
    result = auto.search(model, world, inputs, loss_fn=loss_fn, optimizer=OPTIMIZER, example_target=target,
                         calibration=calibration)
    legal = spread(sorted((c for c in result.candidates if not c.reason), key=lambda c: c.cost), limit)
    measured = measure_steps(model, [c.strategy for c in legal], inputs, loss_fn, OPTIMIZER, target, steps=steps,
                             warmup=warmup)
    for candidate, seconds in zip(legal, measured):
        candidate.measured = seconds
    again = [measure_steps(model, [c.strategy for c in legal], inputs, loss_fn, OPTIMIZER, target, steps=steps,
                           warmup=warmup) for _ in range(passes - 1)]
    return scored(name, world, calibration, calibrated, legal, again)


def scored(name: str, world: int, calibration, calibrated: float, legal: List, again: List[List[float]]) -> Dict:
    """The comparison of `legal` candidates' predictions (.cost, in the predicted order) with
    their measured times (.measured), as report() prints it."""
    errors = [abs(c.cost - c.measured) / c.measured for c in legal]
    return {"name": name, "world": world, "calibration": calibration, "calibrated_s": calibrated, "legal": legal,
            "max_error": max(errors), "within": sum(e <= ERROR_TARGET for e in errors),
            "spearman": spearman([c.cost for c in legal], [c.measured for c in legal]),
            "winner": legal[0].measured / min(c.measured for c in legal) - 1,
            "noise": [spearman([c.measured for c in legal], times) for times in again],
            "again": again}


def recorded(text: str) -> List[Dict]:
    """Each model and world of a report(): its name, world, calibration and the measured
    seconds of each candidate by label."""
    found = []
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        name, world = re.match(r"(\w+), world (\d+)", section).groups()
        calibration = re.search(r"```json\n(.*?)\n```", section, flags=re.S)
        if calibration is None:
            raise SystemExit(f"--rescore: the {name} world {world} section has no calibration JSON (reports "
                             f"written before the JSON was added cannot be re-scored); run bench_auto.py again")
        measured = {}
        for row in re.findall(r"^\| (dp=[^|]*?) \| [^|]* \| ([\d.]+) \|", section, flags=re.M):
            measured[row[0]] = float(row[1]) / 1e3
        found.append({"name": name, "world": int(world), "measured": measured,
                      "calibration": _calibration_of(calibration.group(1), f"{name} world {world}")})
    return found


def _calibration_of(text: str, section: str) -> Calibration:
    """A report's calibration JSON as this checkout's Calibration, or a refusal that names the
    section and both formats (a calibration's fields change with calibrate.FORMAT)."""
    try:
        return Calibration.from_json(text)
    except (TypeError, KeyError) as exc:
        recorded_format = json.loads(text).get("key", {}).get("format")
        raise SystemExit(f"--rescore: the {section} calibration is of format {recorded_format}, whose fields this "
                         f"checkout's Calibration (format {FORMAT}) does not read ({exc}); re-score it with the "
                         f"checkout that wrote it, or run bench_auto.py again") from None


def rescore(text: str) -> List[Dict]:
    """A report()'s candidates predicted again by this checkout's time model with the
    calibration recorded beside them, compared with their recorded measured times."""
    found = []
    for run in recorded(text):
        model, inputs, loss_fn, target = build(run["name"])
        result = auto.search(model, run["world"], inputs, loss_fn=loss_fn, optimizer=OPTIMIZER,
                             example_target=target, calibration=run["calibration"])
        legal = sorted((c for c in result.candidates if not c.reason and c.label() in run["measured"]),
                       key=lambda c: c.cost)
        missing = set(run["measured"]) - {c.label() for c in legal}
        if missing:
            raise SystemExit(f"--rescore: {len(missing)} recorded candidates of {run['name']} world {run['world']} "
                             f"are not legal candidates of this checkout's search, e.g. {sorted(missing)[0]!r}")
        for candidate in legal:
            candidate.measured = run["measured"][candidate.label()]
        found.append(scored(run["name"], run["world"], run["calibration"], run["calibration"].seconds, legal, []))
    return found


def report(found: List[Dict]) -> str:
    lines = ["| model | world | candidates | within 25% | largest error | Spearman | predicted winner vs measured best |"
             " calibration (s) | Spearman, measured vs measured again |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in found:
        lines.append(f"| {r['name']} | {r['world']} | {len(r['legal'])} | {r['within']} | {r['max_error']:.0%} | "
                     f"{r['spearman']:.2f} | {r['winner']:+.1%} | {r['calibrated_s']:.1f} | "
                     f"{', '.join(f'{n:.2f}' for n in r['noise']) or '-'} |")
    for r in found:
        lines += ["", f"### {r['name']}, world {r['world']}", "", "```text", r["calibration"].to_text(), "```", "",
                  "<details><summary>the calibration as JSON (for --rescore)</summary>", "", "```json",
                  r["calibration"].to_json(), "```", "", "</details>", "",
                  "| strategy | predicted (ms) | measured (ms) | error | measured again (ms) |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {c.label()} | {c.cost * 1e3:.1f} | {c.measured * 1e3:.1f} | "
                  f"{(c.cost - c.measured) / c.measured:+.0%} | "
                  f"{', '.join(f'{times[i] * 1e3:.1f}' for times in r['again']) or '-'} |"
                  for i, c in enumerate(r["legal"])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="world sizes (default 2,4)")
    parser.add_argument("--models", default="gpt,llama", help="gpt, llama or both (default)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per candidate, median (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--passes", type=int, default=2,
                        help="times every candidate is measured; the first is compared with the prediction, the "
                             "others with the first (default 2)")
    parser.add_argument("--limit", type=int, default=0,
                        help="run only this many legal candidates, spread over the predicted order (default: all)")
    parser.add_argument("--rescore", action="append", type=argparse.FileType(), default=[], metavar="FILE",
                        help="run nothing: predict the candidates of a report this script wrote again, with its "
                             "calibrations, and compare with its measured times (repeatable)")
    _common.add_out_option(parser, "/tmp/bench_auto.md")
    args = parser.parse_args()
    if args.rescore:
        found = [r for f in args.rescore for r in rescore(f.read())]
        sources = ", ".join(f.name for f in args.rescore)
        _common.emit("\n".join([report(found), "", f"Predicted by this checkout's time model with the calibrations "
                                 f"and against the measured times recorded in {sources}."]), args.out)
        return
    before = _common.load_average()
    found = [compare(name, int(world), args.steps, args.warmup, args.passes, args.limit)
             for world in args.worlds.split(",") for name in args.models.split(",")]
    lines = [report(found), "", *_common.reproduce_lines("1 thread per rank", before, _common.load_average(),
                                                         "bench_auto.py")]
    _common.emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
