"""One record per node: every annotation a pass leaves on a node is a typed NodeRecord field,
written only through graphpar.ir's helpers and checked by the validator after every pass.
(The scan that no other module writes node.meta: tests/project/test_record_scan.py.)"""

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from graphpar.frontend.compile import lower_rank
from graphpar.ir import PHASE_STEP, PHASE_WRITE, NodeRecord, TensorMeta, record, set_record, stamp
from graphpar.ir.validate import GraphValidationError, validate, validate_update_program
from tests.helpers import lm_loss, tiny_gpt, token_batch


# --------------------------------------------------------------------------------------- #
# model programs


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return (F.linear(x, self.fc.weight, self.fc.bias).sum(),)


def _program() -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(Tiny())
    for node in gm.graph.nodes:
        if node.op != "output":
            set_record(node, NodeRecord(value=None))
    return gm


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def test_update_placement_on_a_parameter_is_accepted():
    gm = _program()
    stamp(_node(gm, "fc_weight"), "place_on_host", update_placement="host")
    validate(gm, "place_on_host")
    assert record(_node(gm, "fc_weight")).set_by == "place_on_host"
    assert "update@host" in record(_node(gm, "fc_weight")).describe()


@pytest.mark.parametrize("name,changes,problem", [
    ("fc_weight", {"update_placement": "disk"}, r"node 'fc_weight' .*update_placement 'disk'.*Fix: .*'device', 'host'"),
    ("linear", {"update_placement": "host"}, r"node 'linear' .*not the get_attr of a trainable parameter.*Fix:"),
    ("x", {"update_placement": "device"}, r"node 'x' .*not the get_attr of a trainable parameter"),
    ("linear", {"bucket": 0}, r"node 'linear' .*bucket 0 .*only nodes of the update program carry.*Fix:"),
    ("sum_1", {"phase": PHASE_STEP}, r"node 'sum_1' .*phase 'step'.*only nodes of the update program"),
])
def test_bad_annotation_on_the_model_program_names_the_pass(name, changes, problem):
    gm = _program()
    stamp(_node(gm, name), "bad_pass", **changes)
    with pytest.raises(GraphValidationError, match=r"after pass 'bad_pass': " + problem):
        validate(gm, "bad_pass")


def test_a_frozen_parameter_gets_no_update_placement():
    gm = _program()
    gm.fc.weight.requires_grad_(False)
    stamp(_node(gm, "fc_weight"), "bad_pass", update_placement="device")
    with pytest.raises(GraphValidationError, match="not the get_attr of a trainable parameter"):
        validate(gm, "bad_pass")


def test_set_record_refuses_what_is_not_a_record():
    gm = _program()
    with pytest.raises(TypeError, match="must be a graphpar.ir.NodeRecord"):
        set_record(_node(gm, "x"), {"bucket": 0})


def put_update_placement_on_the_loss(gm, ctx):
    """A buggy user pass: tags a node that has no optimizer update."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    stamp(output.args[0][0], "tag_loss", update_placement="host")
    return gm


def test_a_pipeline_pass_that_writes_a_bad_field_is_named():
    x, y = token_batch(batch=2)
    strategy = gp.Strategy(passes=(gp.Pass("tag_loss", put_update_placement_on_the_loss, after="place_on_host"),))
    with pytest.raises(GraphValidationError, match=r"after pass 'tag_loss': node .*update_placement 'host' but is "
                                                   r"not the get_attr of a trainable parameter"):
        lower_rank(tiny_gpt(), strategy, (x,), rank=0, world_size=1, loss_fn=lm_loss, example_target=y)


# --------------------------------------------------------------------------------------- #
# update programs


class Step(nn.Module):
    def forward(self, *args):
        return torch.zeros(1)


def _update_program(*nodes, buckets=1) -> torch.fx.GraphModule:
    """A program of call_module nodes: (name, input names, bucket, phase), in order."""
    root, graph, made = nn.Module(), torch.fx.Graph(), {}
    for name, inputs, bucket, phase in nodes:
        root.add_module(name, Step())
        made[name] = graph.call_module(name, tuple(made[i] for i in inputs))
        set_record(made[name], NodeRecord(value=TensorMeta((1,), torch.float32), bucket=bucket, phase=phase,
                                          set_by="build_update"))
    graph.output(None)
    program = torch.fx.GraphModule(root, graph, class_name="GraphparUpdate")
    program.buckets = [[] for _ in range(buckets)]
    return program


def test_a_well_formed_update_program_is_accepted():
    validate_update_program(_update_program(
        ("grads_0", (), 0, PHASE_STEP), ("update_0", ("grads_0",), 0, PHASE_STEP),
        ("write_0", ("update_0",), 0, PHASE_WRITE), ("tables", (), None, PHASE_WRITE)), "build_update")


@pytest.mark.parametrize("nodes,buckets,problem", [
    ([("grads_0", (), 0, "later")], 1, r"node 'grads_0' .*phase 'later' in the update program.*Fix: .*'step', 'write'"),
    ([("grads_0", (), 0, None)], 1, r"node 'grads_0' .*phase None"),
    ([("grads_0", (), 2, PHASE_STEP)], 2, r"node 'grads_0' .*bucket 2, but the program has 2 bucket\(s\).*Fix:"),
    ([("grads_0", (), -1, PHASE_STEP)], 1, r"node .grads_0. .*has bucket -1,"),
    ([("grads_0", (), True, PHASE_STEP)], 2, r"node .grads_0. .*has bucket True,"),
    ([("grads_0", (), None, PHASE_STEP)], 1, r"node 'grads_0' .*a step with no bucket.*Fix:"),
    ([("write_0", (), 0, PHASE_WRITE), ("update_0", ("write_0",), 0, PHASE_STEP)], 1,
     r"node 'update_0' .*\(step, bucket 0\) reads 'write_0' \(write, bucket 0\)"),
    ([("grads_0", (), 0, PHASE_STEP), ("grads_1", ("grads_0",), 1, PHASE_STEP)], 2,
     r"node 'grads_1' .*reads 'grads_0' \(step, bucket 0\)"),
])
def test_bad_update_program_names_the_pass(nodes, buckets, problem):
    with pytest.raises(GraphValidationError, match=r"after pass 'bad_pass': " + problem):
        validate_update_program(_update_program(*nodes, buckets=buckets), "bad_pass")


def test_update_placement_is_refused_in_the_update_program():
    program = _update_program(("grads_0", (), 0, PHASE_STEP))
    stamp(next(iter(program.graph.nodes)), "bad_pass", update_placement="host")
    with pytest.raises(GraphValidationError, match=r"after pass 'bad_pass': .*update_placement 'host' in the update"):
        validate_update_program(program, "bad_pass")


def test_the_compiled_update_program_carries_its_buckets_and_phases(tmp_path):
    x, y = token_batch(batch=2)
    result = lower_rank(tiny_gpt(), gp.Strategy(offload_optimizer=True), (x,), rank=0, world_size=1,
                        loss_fn=lm_loss, example_target=y, bucket_bytes=4096, dump=str(tmp_path))
    program = result.ctx.results.update
    records = {n.name: record(n) for n in program.graph.nodes if n.op != "output"}
    assert len(program.buckets) > 1
    for k in range(len(program.buckets)):
        assert (records[f"grads_{k}"].bucket, records[f"grads_{k}"].phase) == (k, PHASE_STEP)
        assert (records[f"grads_{k}_host"].bucket, records[f"grads_{k}_host"].phase) == (k, PHASE_STEP)
        assert (records[f"update_{k}"].bucket, records[f"update_{k}"].phase) == (k, PHASE_STEP)
        # the weights come back to the device after backward, with the write that reads them
        assert (records[f"update_{k}_device"].bucket, records[f"update_{k}_device"].phase) == (k, PHASE_WRITE)
        assert (records[f"write_{k}"].bucket, records[f"write_{k}"].phase) == (k, PHASE_WRITE)
    params = [n for n in result.gm.graph.nodes if n.op == "get_attr" and record(n).value.requires_grad]
    assert params and all(record(n).update_placement == "host" for n in params)
    buffers = [n for n in result.gm.graph.nodes if n.op == "get_attr" and not record(n).value.requires_grad]
    assert all(record(n).update_placement is None for n in buffers)
    # and the dumps show them
    dumps = tmp_path / "rank0"
    placed = next(dumps.glob("*_place_on_host.py")).read_text()
    assert all(f"update@host {record(n).module_path} [place_on_host]" in placed for n in params)
    update = next(dumps.glob("[0-9][0-9]_update.py")).read_text()  # after the passes: the update program
    assert "self.grads_0()  # f32[" in update and "bucket 0 step [build_update]" in update
    assert "= self.write_0(update_0_device)  # f32[" in update and "bucket 0 write [build_update]" in update
