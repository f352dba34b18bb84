"""`graphpar demo`: train the small GPT on a bundled text with graphpar, then check it.

The run has two parts, both on every rank:

1. Training: the GPT from graphpar.models.gpt, compiled with the requested strategy, is
   trained for `steps` steps on random windows of graphpar/assets/corpus.txt (the opening
   chapters of Alice's Adventures in Wonderland, byte-level tokens, vocab 256), with a
   progress bar showing the loss and tokens/s.
2. Parity: a fresh model from the same initial weights is trained eagerly on one device with
   torch.optim.AdamW for `check_steps` steps, and so is a freshly compiled copy on the same
   batches; their losses and final parameters must agree within the tolerances below.

Every rank writes its per-pass graph dumps under `out`/dumps/rank<R>; the driver writes
summary.json from rank 0's results. `train_rank` is a module-level function so that
`graphpar.launch` can start it in every process of a multi-process world.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import pathlib
import time
from typing import Dict, Iterator, List, Tuple

import torch
from tqdm import tqdm

from graphpar.distributed import groups as distributed
from graphpar.distributed.launch import launch
from graphpar.frontend.compile import compile as graphpar_compile
from graphpar.strategy import Strategy
from graphpar.tools.timeline import write_timeline
from graphpar.models.gpt import GPT, GPTConfig, lm_loss, num_parameters

CORPUS = pathlib.Path(__file__).parents[1] / "assets" / "corpus.txt"
N_HEAD = 4

# Parity tolerances. graphpar runs the same float32 operations as eager PyTorch, but not
# always in the same order: microbatch gradients are accumulated one microbatch at a time and
# the traced program may reorder reductions. Float32 keeps ~7 significant digits, so the
# losses (~5) differ by a few 1e-7; LOSS_TOLERANCE leaves a margin of ~100x, while a real bug
# (a missing gradient sync, a microbatch left out, a stale weight, an update of the wrong
# size) moves the loss by 1e-2 or more within a few steps (a doubled learning rate: 8e-2 at
# the second step). Not caught here: a gradient scaled by a constant, which AdamW's
# normalisation cancels; that takes a comparison of the gradients themselves.
# Parameters drift further: AdamW divides each gradient by its running RMS, so elements with
# tiny gradients turn rounding noise into visible update differences, and the drift compounds
# over steps (measured on the default model with 4 microbatches: ~4e-6 after 10 steps, ~5e-5
# after 60; with one microbatch the two runs are bitwise equal). An AdamW
# update moves an element by at most ~lr per step, so a bug shows as a difference of order
# lr * steps; the tolerance is 2% of that: 1e-4 for the default 5 steps at lr 1e-3.
LOSS_TOLERANCE = 1e-4
PARAM_TOLERANCE_PER_LR_STEP = 0.02


def param_tolerance(lr: float, steps: int) -> float:
    return PARAM_TOLERANCE_PER_LR_STEP * lr * steps


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything one rank needs; picklable so graphpar.launch can send it to each process.

    `batch_size` is the global batch (all DP ranks together), so runs with different
    degrees see the same data and their losses can be compared.
    """
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 64
    layers: int = 2
    n_embd: int = 64
    lr: float = 1e-3
    strategy: Strategy = Strategy()   # its seed also seeds the data and the model
    check_steps: int = 5
    out: str = "graphpar_demo_out"

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=256, block_size=self.seq_len, n_layer=self.layers,
                         n_head=N_HEAD, n_embd=self.n_embd)


# ---- data --------------------------------------------------------------------------------
def load_corpus() -> torch.Tensor:
    return torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()


def batches(corpus: torch.Tensor, config: DemoConfig) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of random windows; seeded, so every rank and every run draws the same."""
    generator = torch.Generator().manual_seed(config.strategy.seed)
    offsets = torch.arange(config.seq_len + 1)
    while True:
        starts = torch.randint(0, corpus.numel() - config.seq_len - 1, (config.batch_size, 1),
                               generator=generator)
        windows = corpus[starts + offsets]
        yield windows[:, :-1], windows[:, 1:]


def dp_slice(batch: Tuple[torch.Tensor, ...], mesh) -> Tuple[torch.Tensor, ...]:
    """This DP rank's rows of a global batch (train_step takes the DP-local batch)."""
    return tuple(t.chunk(mesh.dp, dim=0)[mesh.dp_rank] for t in batch)


# ---- model -------------------------------------------------------------------------------
def build_model(config: DemoConfig) -> GPT:
    torch.manual_seed(config.strategy.seed)
    return GPT(config.model_config())


def compile_model(model: GPT, config: DemoConfig, example: Tuple[torch.Tensor, torch.Tensor]):
    x, y = example
    local_batch = config.batch_size // config.strategy.dp
    return graphpar_compile(model, config.strategy, example_inputs=(x[:local_batch],),
                            example_target=y[:local_batch], loss_fn=lm_loss,
                            optimizer=functools.partial(torch.optim.AdamW, lr=config.lr))


# ---- training ----------------------------------------------------------------------------
def train_step(pm, batch: Tuple[torch.Tensor, torch.Tensor]) -> float:
    x, y = dp_slice(batch, pm.mesh)
    return pm.train_step(x, target=y)


def train(pm, data: Iterator, config: DemoConfig, show: bool) -> Dict[str, object]:
    losses: List[float] = []
    tokens_per_step = config.batch_size * config.seq_len
    bar = tqdm(range(config.steps), desc="graphpar train", unit="step", disable=not show)
    start = time.perf_counter()
    for step in bar:
        losses.append(train_step(pm, next(data)))
        # The rate since the start, not per step: single steps take a few milliseconds and
        # their timings jump with whatever else the machine is doing.
        rate = tokens_per_step * (step + 1) / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{rate:,.0f}")
    elapsed = time.perf_counter() - start
    return {"losses": losses, "train_s": elapsed,
            "tokens_per_s": tokens_per_step * config.steps / elapsed}


# ---- parity ------------------------------------------------------------------------------
def train_eager(model: GPT, data: Iterator, config: DemoConfig) -> Tuple[List[float], Dict]:
    """The single-device reference: plain PyTorch on the global batch."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    losses = []
    for _ in range(config.check_steps):
        x, y = next(data)
        optimizer.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def check_parity(initial: Dict[str, torch.Tensor], corpus: torch.Tensor, config: DemoConfig) -> Dict:
    """Eager vs graphpar from the same weights on the same batches (see the tolerances)."""
    eager_model = build_model(config)
    eager_model.load_state_dict(initial)
    eager_losses, eager_state = train_eager(eager_model, batches(corpus, config), config)

    compiled_model = build_model(config)
    compiled_model.load_state_dict(initial)
    data = batches(corpus, config)
    pm = compile_model(compiled_model, config, next(batches(corpus, config)))
    graphpar_losses = [train_step(pm, next(data)) for _ in range(config.check_steps)]
    graphpar_state = pm.full_state_dict()

    loss_diff = max(abs(a - b) for a, b in zip(eager_losses, graphpar_losses))
    tolerance = param_tolerance(config.lr, config.check_steps)
    param_diff = max((eager_state[k] - graphpar_state[k]).abs().max().item() for k in eager_state)
    return {"steps": config.check_steps, "eager_losses": eager_losses,
            "graphpar_losses": graphpar_losses, "max_loss_diff": loss_diff,
            "max_param_diff": param_diff, "loss_tolerance": LOSS_TOLERANCE,
            "param_tolerance": tolerance,
            "passed": loss_diff <= LOSS_TOLERANCE and param_diff <= tolerance}


def write_report(pm, out: pathlib.Path) -> None:
    """The planner's per-rank memory and communication plan of the run, in three formats."""
    report = pm.report()
    (out / "report.txt").write_text(report.to_text() + "\n")
    (out / "report.json").write_text(report.to_json() + "\n")
    report.to_html(str(out / "report.html"))


# ---- one rank ----------------------------------------------------------------------------
def train_rank(config: DemoConfig) -> Dict[str, object]:
    """The whole demo on one rank; returns what summary.json records (rank 0's is used)."""
    # One intra-op thread: the demo's ops are too small to gain from a second one (7 vs 9 ms
    # a step on an idle 2-core machine), and when anything else runs on the cores, OpenMP
    # threads wait on each other and a step takes 40x longer (measured: 300+ ms).
    torch.set_num_threads(1)
    corpus = load_corpus()
    model = build_model(config)
    initial = copy.deepcopy(model.state_dict())
    data = batches(corpus, config)
    start = time.perf_counter()
    pm = compile_model(model, config, next(batches(corpus, config)))
    compile_s = time.perf_counter() - start
    show = distributed.rank() == 0
    if show:
        print(f"graphpar demo: GPT with {num_parameters(model):,} parameters ({config.layers} layers, "
              f"n_embd {config.n_embd}), {corpus.numel():,}-byte corpus, strategy "
              f"dp={config.strategy.dp} tp={config.strategy.tp} pp={config.strategy.pp} "
              f"microbatches={config.strategy.microbatches}; "
              f"compiled in {compile_s:.2f} s ({pm.front_end} front end)", flush=True)
    training = train(pm, data, config, show)
    dumps = pm.dump(str(pathlib.Path(config.out) / "dumps"))
    timeline = pm.timeline()  # the last training step, for the pipeline drawing
    if show:
        write_report(pm, pathlib.Path(config.out))
    parity = check_parity(initial, corpus, config) if config.check_steps > 0 else None
    return {"config": dataclasses.asdict(config), "parameters": num_parameters(model),
            "front_end": pm.front_end, "compile_s": compile_s, **training,
            "dumps": dumps, "parity": parity, "timeline": timeline,
            "mesh": (pm.mesh.dp_rank, pm.mesh.tp_rank, pm.mesh.pp_rank)}


# ---- driver ------------------------------------------------------------------------------
def run(config: DemoConfig) -> int:
    """Run the demo (in one process, or one per rank), report, and return the exit code."""
    pathlib.Path(config.out).mkdir(parents=True, exist_ok=True)
    if config.world_size == 1:
        results = [train_rank(config)]
    else:
        results = launch(train_rank, config.world_size, args=(config,))
    result = results[0]
    pipeline = [r["timeline"] for r in sorted(results, key=lambda r: r["mesh"][2])
                if r["mesh"][:2] == (0, 0)]
    if any(pipeline):
        result["timeline"] = write_timeline(pipeline, config.out)
    else:
        result.pop("timeline")
    passed = result["parity"] is None or result["parity"]["passed"]
    summary_path = pathlib.Path(config.out) / "summary.json"
    summary_path.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    if "timeline" in result:
        print(f"pipeline timeline (last step, measured bubble {result['timeline']['bubble_fraction']:.1%}): "
              f"{result['timeline']['trace']} (open in Perfetto), {result['timeline']['svg']}")
    print(f"per-rank memory and communication plan: {pathlib.Path(config.out) / 'report.txt'} (.json, .html)")
    print(f"output folder: {pathlib.Path(config.out).resolve()}")
    return 0 if passed else 1


def report(result: Dict) -> str:
    losses = result["losses"]
    lines = [f"trained {len(losses)} steps in {result['train_s']:.1f} s: loss {losses[0]:.4f} -> "
             f"{losses[-1]:.4f}, {result['tokens_per_s']:,.0f} tokens/s"]
    parity = result["parity"]
    if parity is None:
        return "\n".join(lines + ["parity check skipped (--check-steps 0)"])
    lines += ["", f"parity check: eager PyTorch vs graphpar, {parity['steps']} AdamW steps from the "
                  f"same initial weights", "",
              "| step | eager loss | graphpar loss | abs diff |",
              "|-----:|-----------:|--------------:|---------:|"]
    for step, (a, b) in enumerate(zip(parity["eager_losses"], parity["graphpar_losses"]), 1):
        lines.append(f"| {step:4d} | {a:10.6f} | {b:13.6f} | {abs(a - b):8.2e} |")
    lines += ["", f"max |loss diff|  = {parity['max_loss_diff']:.2e} (tolerance {parity['loss_tolerance']:.1e})",
              f"max |param diff| = {parity['max_param_diff']:.2e} (tolerance {parity['param_tolerance']:.1e})",
              f"parity: {'PASS' if parity['passed'] else 'FAIL'}"]
    return "\n".join(lines)
