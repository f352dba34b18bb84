"""Writing your own graphpar passes: one that reads the graph, one that rewrites it.

What it shows
    A graphpar pass is a plain function ``fn(gm, ctx) -> gm`` over a torch.fx GraphModule
    whose every node carries a graphpar record (``graphpar.ir.record(node)``: the value's
    shape and dtype, the module it came from, its tensor-parallel layout, its stage, and
    ``set_by``, the pass that wrote it last). Two passes, on the small GPT:

    * ``count_ops_per_module`` only reads: it counts the operations of each module from
      the records' ``module_path`` and leaves the table as a typed result of its own
      (``ctx.results.put(OpCounts(...))``), which reaches the rank's hand-off
      (``pm.compiled.extra(OpCounts)``). It declares ``produces=(OpCounts,)`` and is added
      to every later compile in this process with ``gp.register_pass``.
    * ``tanh_gelu`` rewrites: it replaces each exact GELU with the tanh approximation
      (GPT-2's original ``gelu_new``). It creates a new node, gives it the old node's record
      with ``graphpar.ir.copy_record`` (stamped ``set_by="tanh_gelu"``), reroutes the users
      and erases the old node. Without a record, graphpar's validator would stop the compile
      right after the pass and name it. It is given to one compile only, in
      ``gp.Strategy(passes=...)``.

    ``gp.list_passes()`` shows the pipeline with the registered pass, and
    ``gp.list_passes(strategy)`` with the strategy's pass too; ``pm.dump(directory)``
    writes the graph after every pass (``rank0/NN_<pass>.py``, ``.json``, ``.dot``), where
    the rewritten nodes show ``[tanh_gelu]``.

What it checks
    Both passes appear in the pipeline where they were anchored; the op counts include one
    GELU per MLP; the compiled model's output and loss equal eager PyTorch's with tanh GELU
    (and differ from exact GELU); the dump of the tanh_gelu pass contains the rewritten
    nodes; and after ``gp.unregister_pass`` the pipeline is back to the built-ins. Both
    front ends (symbolic_trace and torch.export) are exercised. Exits 1 otherwise.

How to run
    python examples/custom_pass.py                    # dumps into a temporary directory
    python examples/custom_pass.py --out my_dump      # keep the dump
    python examples/custom_pass.py --small            # CI: the same, and the dump is deleted
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F

import graphpar as gp
import graphpar.ir as ir
from graphpar.models.gpt import GPT, GPTConfig, lm_loss

# symbolic_trace leaves F.gelu calls, torch.export leaves aten.gelu: match both spellings
GELU_OPS = (F.gelu, torch.ops.aten.gelu.default)


# ---- the passes -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpCounts:
    """count_ops_per_module's result: module -> {op name: count}."""
    per_module: dict


def count_ops_per_module(gm: torch.fx.GraphModule, ctx: gp.PassContext) -> torch.fx.GraphModule:
    """Count the operations of each top-level module (blocks.0, blocks.1, lm_head, ...)."""
    counts = collections.defaultdict(collections.Counter)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            path = ir.record(node).module_path
            module = ".".join(path.split(".")[:2]) if path.startswith("blocks.") else (path or "<top>")
            counts[module][getattr(node.target, "__name__", str(node.target))] += 1
    ctx.results.put(OpCounts({module: dict(ops) for module, ops in counts.items()}))
    return gm   # the graph is unchanged; a pass always returns a GraphModule


def tanh_gelu(gm: torch.fx.GraphModule, ctx: gp.PassContext) -> torch.fx.GraphModule:
    """Replace every exact GELU with GELU's tanh approximation."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in GELU_OPS:
            continue
        if node.kwargs.get("approximate", "none") == "tanh":
            continue
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(node.target, node.args, {**node.kwargs, "approximate": "tanh"})
        # The new node computes a value of the same shape, in the same module: it takes the old
        # node's record (shape, dtype, module path, layout...), stamped with this pass's name.
        ir.copy_record(node, new, "tanh_gelu")
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    return gm


# ---- the model and the eager reference --------------------------------------------------------
def make_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    with torch.no_grad():   # GELU inputs of order 1, where the two GELUs differ visibly
        for block in model.blocks:
            block.mlp.fc.weight.mul_(25)
    return model


@contextlib.contextmanager
def eager_tanh_gelu():
    """Eager PyTorch with tanh GELU: GPT's MLP calls F.gelu, so swap it for the reference."""
    exact = F.gelu
    F.gelu = functools.partial(exact, approximate="tanh")
    try:
        yield
    finally:
        F.gelu = exact


def check(condition: bool, message: str, failures: list) -> None:
    print(("ok   " if condition else "FAIL ") + message)
    if not condition:
        failures.append(message)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="CI: the example is already small; delete the temporary dump at the end")
    parser.add_argument("--out", default=None, help="dump directory (default: a temporary one)")
    args = parser.parse_args(argv)
    failures: list = []

    model = make_model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    with torch.no_grad():
        exact_logits = model(x)
        with eager_tanh_gelu():
            tanh_logits = model(x)
    tanh_loss = lm_loss(tanh_logits, y).item()

    builtins = gp.list_passes()
    print("built-in passes:        ", builtins)

    # 1. For every later compile in this process (a decorator works too:
    #    @gp.register_pass(name="count_ops_per_module", after="trace") on the function).
    gp.register_pass(name="count_ops_per_module", after="trace", produces=(OpCounts,))(count_ops_per_module)
    try:
        print("after gp.register_pass: ", gp.list_passes())
        check(gp.list_passes()[:2] == ["trace", "count_ops_per_module"],
              "the registered pass runs right after trace", failures)

        # 2. For this compile only: the strategy's passes (a callable, a gp.Pass, or a
        #    "module:function" string; gp.Pass can anchor it).
        strategy = gp.Strategy(passes=(gp.Pass("tanh_gelu", tanh_gelu, after="count_ops_per_module"),))
        print("with Strategy(passes=): ", gp.list_passes(strategy))
        check(gp.list_passes(strategy)[1:3] == ["count_ops_per_module", "tanh_gelu"],
              "the strategy's pass follows its anchor", failures)
        check("tanh_gelu" not in gp.list_passes(), "the strategy's pass is not in the global pipeline", failures)

        for tracer in ("fx", "export"):
            pm = gp.compile(model, strategy, example_inputs=(x,), example_target=y, loss_fn=lm_loss,
                            tracer=tracer)
            print(f"\n--- tracer={tracer!r} ---")
            counts = pm.compiled.extra(OpCounts).per_module   # the pass's result, in the rank's hand-off
            for module, ops in counts.items():
                print(f"  {module:<10} {sum(ops.values()):3d} ops  {dict(sorted(ops.items()))}")
            gelus = sum(n for ops in counts.values() for op, n in ops.items() if "gelu" in op)
            check(gelus == 2, f"{tracer}: count_ops_per_module found one GELU per MLP ({gelus})", failures)
            logits = pm(x)
            diff_tanh = (logits - tanh_logits).abs().max().item()
            diff_exact = (logits - exact_logits).abs().max().item()
            check(diff_tanh < 1e-5, f"{tracer}: pm(x) equals eager with tanh GELU (max diff {diff_tanh:.1e})",
                  failures)
            check(diff_exact > 1e-5, f"{tracer}: and differs from exact GELU (max diff {diff_exact:.1e})",
                  failures)
            loss = pm.train_step(x, target=y)
            check(abs(loss - tanh_loss) < 1e-5, f"{tracer}: train_step loss {loss:.6f} equals eager "
                  f"{tanh_loss:.6f}", failures)

        # 3. The graph after every pass, for this rank.
        out = pm.dump(args.out or tempfile.mkdtemp(prefix="graphpar_custom_pass_"))   # returns the absolute path
        rank_dir = os.path.join(out, "rank0")
        print(f"\npm.dump wrote {len(os.listdir(rank_dir))} files to {rank_dir}:")
        print("  " + " ".join(sorted(f for f in os.listdir(rank_dir) if f.endswith(".py"))))
        source = open(os.path.join(rank_dir, "02_tanh_gelu.py")).read()
        rewritten = [line.strip() for line in source.splitlines() if "[tanh_gelu]" in line]
        print("rewritten nodes in 02_tanh_gelu.py:")
        for line in rewritten:
            print("  " + line)
        check(len(rewritten) == 2 and all("tanh" in line for line in rewritten),
              "the dump shows both rewritten GELUs, stamped [tanh_gelu]", failures)
    finally:
        gp.unregister_pass("count_ops_per_module")
        if args.small and not args.out and "out" in locals():
            shutil.rmtree(out, ignore_errors=True)   # CI: leave no temporary dump behind
    check(gp.list_passes() == builtins, "gp.unregister_pass restores the built-in pipeline", failures)

    if failures:
        print(f"FAIL: {len(failures)} check(s) failed")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
