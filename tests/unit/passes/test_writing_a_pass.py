"""A new pass written from docs/writing-a-pass.md alone: it reads a typed result
(`ctx.results.program`), writes only through the record helpers (`copy_record`), declares
what it requires and produces, and leaves a typed result of its own, which reaches the
rank's hand-off (`pm.compiled`) and the dump."""
import dataclasses

import torch

import graphpar as gp
import graphpar.ir as ir
from graphpar.models.gpt import GPT, GPTConfig, lm_loss


@dataclasses.dataclass(frozen=True)
class Negated:
    """negate_logits' result: the node it added and the module it stands in."""
    node: str
    module_path: str


def negate_logits(gm, ctx):
    """Negate the model's first output, for the loss and for pm(x)."""
    output = next(node for node in gm.graph.nodes if node.op == "output")
    logits = output.args[0][1 if ctx.results.program.has_loss else 0]
    with gm.graph.inserting_after(logits):
        negated = gm.graph.call_function(torch.neg, (logits,))
    logits.replace_all_uses_with(negated, delete_user_cb=lambda user: user is not negated)
    ir.copy_record(logits, negated, "negate_logits")
    ctx.results.put(Negated(negated.name, ir.record(negated).module_path))
    return gm


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))


def test_a_pass_written_from_the_page_runs_and_reaches_the_hand_off_and_the_dump(tmp_path):
    model = _model()
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        expected = -model(x)                     # dropout is 0 in this config
    step = gp.Pass("negate_logits", negate_logits, after="lower_to_rank", requires=("program", "record.value"),
                   produces=(Negated,))
    pm = gp.compile(model, gp.Strategy(passes=(step,)), example_inputs=(x,), loss_fn=lm_loss, example_target=y)

    torch.testing.assert_close(pm(x), expected)
    torch.testing.assert_close(pm.train_step(x, target=y), lm_loss(expected, y).item())
    result = pm.compiled.extra(Negated)          # the pass's result, in the frozen hand-off
    assert result.module_path == "lm_head"
    node = next(n for n in pm.compiled.gm.graph.nodes if n.name == result.node)
    assert node.target is torch.neg and ir.record(node).set_by == "negate_logits"

    index = gp.list_passes(pm.strategy).index("negate_logits")
    dump = (tmp_path / "rank0" / f"{index:02d}_negate_logits.py")
    pm.dump(str(tmp_path))
    line = next(text for text in dump.read_text().splitlines() if text.strip().startswith(f"{result.node} = "))
    assert "torch.neg(" in line and "lm_head [negate_logits]" in line, line
