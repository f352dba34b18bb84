"""docs/errors.md, compile (graphpar/frontend/compile.py, graphpar/runtime/single_stage.py,
graphpar/distributed/mesh.py), and the host-placement entries raised by compile:
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

import functools
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from graphpar.passes import cast_params
from tests.errors.catalogue import entry_test, expect, expect_on_every_rank, expect_untouched, registrar
from tests.errors.models import SGD, TwoInputs, compile_mse, mlp, mse_pm, x4


CASES = {}
case = registrar(CASES)


@case("E-compile-model-type")
def _():
    expect(TypeError, lambda: gp.compile(lambda x: x, gp.Strategy(), (x4(),)), "needs a torch.nn.Module, got function")


@case("E-compile-bare-tensor")
def _():
    expect(TypeError, lambda: gp.compile(mlp(), gp.Strategy(), x4()), "got a bare tensor", r"Fix: example_inputs=\(x,\)")


@case("E-compile-example-type")
def _():
    expect(TypeError, lambda: gp.compile(mlp(), gp.Strategy(), ()), "non-empty tuple", "got tuple", "Fix:")


@case("E-compile-grad-dtype")
def _(monkeypatch):
    # this torch has Tensor.grad_dtype; an older one is stood in for by the check's own predicate
    monkeypatch.setattr(cast_params, "grad_dtype_supported", lambda: False)
    for strategy in ({"param_dtype": "bf16"}, {"param_dtype": "fp16", "reduce_dtype": "fp32"}):
        expect_untouched(ValueError, lambda model, s=strategy: gp.compile(model, s, (x4(),), loss_fn=F.mse_loss,
                                                                          example_target=torch.randn(4, 2)),
                         r"accumulates and reduces the torch\.(bfloat16|float16) weights' gradients in torch\.float32",
                         r"Tensor\.grad_dtype\), which this torch \(.*\) lacks",
                         r"Fix: upgrade torch to a release with Tensor\.grad_dtype, or Strategy\(reduce_dtype=torch")
    # gradients in the compute dtype need no grad_dtype: still compiled on such a torch
    gp.compile(mlp(), {"param_dtype": "bf16", "reduce_dtype": "bf16"}, (x4(),), loss_fn=F.mse_loss,
               example_target=torch.randn(4, 2))


class _BranchOnDtype(nn.Module):
    """A forward that branches on the dtype it computes in: its float32 trace has a cast the
    trace in bf16 has not."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = self.fc(x)
        if h.dtype == torch.float32:
            h = h.to(torch.float32)
        return h


@case("E-compile-param-dtype-export")
def _():
    expect_untouched(ValueError, lambda model: gp.compile(model, {"param_dtype": "bf16"}, (x4(),), loss_fn=F.mse_loss,
                                                          example_target=torch.randn(4, 2), tracer="export"),
                     r"Strategy\(param_dtype=torch\.bfloat16\) cannot compute this model in torch\.bfloat16",
                     r"torch\.export traced it in float32 and fixed the dtypes of its casts",
                     r"the trace in torch\.bfloat16 that says what they mean does not match the program at node to",
                     r"Fix: train without param_dtype, or cast the model yourself \(model\.to\(torch\.bfloat16\)\)",
                     model=_BranchOnDtype())
    # the cast-by-hand fix: pure bf16, no masters
    pm = gp.compile(_BranchOnDtype().to(torch.bfloat16), gp.Strategy(), (x4().bfloat16(),), loss_fn=F.mse_loss,
                    example_target=torch.randn(4, 2, dtype=torch.bfloat16), tracer="export")
    assert all(p.dtype == torch.bfloat16 for p in pm.parameters())


def host_compile(offload, optimizer=None, tie_weights=False):
    from tests.helpers import lm_loss, tiny_gpt, token_batch
    x, y = token_batch(batch=4)
    return lambda: gp.compile(tiny_gpt(tie_weights=tie_weights), gp.Strategy(offload_embedding=offload), (x,),
                              loss_fn=lm_loss, example_target=y, optimizer=optimizer)


@case("E-host-embedding-missing")
def _():
    expect(ValueError, host_compile(["wtee"]), r"offload_embedding names 'wtee', which is not a module",
           r"Fix: use one of its embedding modules: \['wte', 'wpe'\]")


@case("E-host-embedding-type")
def _():
    expect(ValueError, host_compile(["blocks.0.mlp"]), r"names 'blocks.0.mlp', a \w+; only nn.Embedding",
           r"Fix: use one of \['wte', 'wpe'\]")


@case("E-host-embedding-tied")
def _():
    expect(ValueError, host_compile(["wte"], tie_weights=True), r"names 'wte', whose weight is tied",
           r"Fix: untie the weights or leave 'wte' on the device")


@case("E-host-embedding-optimizer")
def _():
    expect(ValueError, host_compile(True, functools.partial(torch.optim.RMSprop, lr=0.1)),
           r"row-wise update, which graphpar has for SGD, Adagrad, Adam and AdamW, not RMSprop",
           r"Fix: use one of those, or offload_embedding=False")


@case("E-host-embedding-decay")
def _():
    expect(ValueError, host_compile(True, functools.partial(torch.optim.SGD, lr=0.1, weight_decay=0.1)),
           r"SGD\(weight_decay=0.1\) would decay every row", r"Fix: weight_decay=0")
    expect(ValueError, host_compile(True, functools.partial(torch.optim.Adam, lr=0.1, weight_decay=0.1)),
           r"Adam\(weight_decay=0.1\) \(L2 in the gradient\) has no row-wise form", r"Fix: use AdamW or weight_decay=0")


@case("E-compile-rank-mismatch")
def _(messages):
    for message in messages:  # rank 1 passed seed=1, rank 0 seed=0: both ranks raise, neither hangs
        assert re.search(r"rank 1 called graphpar.compile with a different strategy than rank 0 \(.*'seed': 1.* vs "
                         r".*'seed': 0", message), message
        assert "Fix: every rank must pass the same Strategy" in message, message


@case("E-compile-batch-dims")
def _():
    expect(ValueError, lambda: gp.compile(TwoInputs(), gp.Strategy(), (x4(4), x4(3))),
           r"every tensor input must share its first \(batch\) dimension", r"\[\(3,\), \(4,\)\]", "Fix:")


@case("E-compile-mesh-rank")
def _():
    from graphpar.distributed.mesh import Mesh
    expect(ValueError, lambda: Mesh(dp=1, tp=2, pp=1, rank=2), "rank 2 is outside a world of 2", "Fix:")


@case("E-compile-optimizer-factory")
def _():
    expect_untouched(TypeError, lambda m: compile_mse(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)),
                     r"optimizer=SGD\(\.\.\.\) is an optimizer instance", r"factory callable\(params\)",
                     r"Fix: pass a factory, e\.g\. optimizer=functools\.partial\(torch\.optim\.AdamW")
    expect(TypeError, lambda: compile_mse(mlp(), optimizer=3), "optimizer=3 is not callable", "Fix:")


@case("E-compile-optimizer-result")
def _():
    expect_untouched(TypeError, lambda m: compile_mse(m, optimizer=lambda params: None),
                     "the optimizer factory .*lambda.* returned None, not a torch.optim.Optimizer",
                     r"Fix: return the optimizer")


@case("E-compile-optimizer-params")
def _():
    # issue #14 item 1: an optimizer over the user's model trained nothing, silently
    expect_untouched(ValueError, lambda m: compile_mse(m, optimizer=lambda params: SGD(m.parameters())),
                     r"returned a SGD over 4 tensor\(s\), 0 of them among the 4 parameter\(s\) graphpar gave it",
                     "must step exactly those", r"Fix: build the optimizer from the factory's argument")
    expect(ValueError, lambda: compile_mse(mlp(), optimizer=lambda params: SGD(list(params)[:1])),
           r"over 1 tensor\(s\), 1 of them among the 4", "Fix:")


@case("E-compile-optimizer-closure")
def _():
    expect_untouched(ValueError, lambda m: compile_mse(m, optimizer=torch.optim.LBFGS),
                     r"optimizer LBFGS needs a closure in step\(closure\)", "no closure",
                     r"Fix: use an optimizer whose step\(closure=None\) has a default")


@case("E-compile-module-name")
def _():
    # issue #14 item 9: a name that matches no module did nothing, silently
    expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), leaf_modules=["00"]),
                     "leaf_modules names '00', which is not a module of Sequential", "would do nothing",
                     "Fix: did you mean '0'")
    expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), tp_replicate=["fc"]),
                     "tp_replicate names 'fc', which is not a module of Sequential",
                     r"Fix: use paths from model.named_modules\(\), e.g. \['0', '1', '2'\]")
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), leaf_modules=[nn.Conv2d]),
           "leaf_modules names the class Conv2d, of which Sequential has no module", "Fix:")


@case("E-compile-backward-hook")
def _():
    # a backward hook graphpar would never call trained silently without it (both front ends)
    def compile_hooked(model):
        model[0].register_full_backward_hook(lambda module, grad_input, grad_output: None)
        return gp.compile(model, gp.Strategy(), (x4(),))
    expect_untouched(ValueError, compile_hooked, r"module\(s\) \['0'\] of Sequential have backward hooks",
                     "would never call", "Fix: remove the hooks before graphpar.compile")
    model = mlp()
    model[2].weight.register_hook(lambda grad: grad * 2)
    expect(ValueError, lambda: gp.compile(model, gp.Strategy(), (x4(),), tracer="export"),
           r"parameter\(s\) \['2.weight'\] of Sequential have backward hooks", "Fix:")


@case("E-compile-module-list-type")
def _():
    expect_untouched(TypeError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), leaf_modules="0"),
                     "leaf_modules='0' is a string, but leaf_modules takes a list of module paths",
                     r"Fix: leaf_modules=\['0'\]")
    expect(TypeError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), tp_replicate=[nn.Linear]),
           r"tp_replicate entry .*Linear.* is a type; entries must be module paths \(str\)", "Fix:")


@case("E-compile-device")
def _():
    expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), device="gpu"),
                     "device='gpu' is not a torch device", "Fix: device='cpu'")
    if torch.cuda.is_available():
        expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),), device="cuda:99"),
               "device='cuda:99' names GPU 99, but this machine has", "Fix:")
    else:
        expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), device="cuda"),
                         r"device='cuda' asks for CUDA, but torch.cuda.is_available\(\) is False",
                         "Fix: device='cpu', or leave device out")


@case("E-compile-dump-dir")
def _(tmp_path, monkeypatch):
    file = tmp_path / "notes.txt"
    file.write_text("")
    expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (x4(),), dump=str(file)),
                     "dump=.*notes.txt' is not a directory: .* is a file", r"Fix: give a directory path.*notes_dump")
    monkeypatch.setenv("GRAPHPAR_DUMP", str(file / "inside"))
    expect(ValueError, lambda: gp.compile(mlp(), gp.Strategy(), (x4(),)), "GRAPHPAR_DUMP=.* is not a directory",
           "Fix:")
    assert not any(tmp_path.glob("rank*"))  # refused before any pass wrote its dump


@case("E-compile-bucket-bytes")
def _():
    expect_untouched(ValueError, lambda m: compile_mse(m, bucket_bytes="25MB"),
                     "bucket_bytes='25MB' is invalid: it must be a positive int number of bytes",
                     r"Fix: bucket_bytes=25 \* 2\*\*20")
    expect(ValueError, lambda: compile_mse(mlp(), bucket_bytes=0), "bucket_bytes=0 is invalid", "Fix:")


@case("E-compile-max-grad-norm")
def _():
    rule = r"it must be a positive number, the largest global gradient norm a step keeps"
    expect_untouched(ValueError, lambda m: compile_mse(m, max_grad_norm=0), r"max_grad_norm=0 is invalid: " + rule,
                     "would make every gradient zero", r"Fix: max_grad_norm=1.0 .*float\('inf'\) to measure")
    expect(ValueError, lambda: compile_mse(mlp(), max_grad_norm=float("nan")), "max_grad_norm=nan is invalid",
           "every gradient nan", "Fix:")
    expect(ValueError, lambda: compile_mse(mlp(), max_grad_norm="1.0"), "max_grad_norm='1.0' is invalid",
           "got a str", r"Fix: max_grad_norm=1.0\.")
    expect(ValueError, lambda: compile_mse(mlp(), max_grad_norm=torch.tensor(2.0)), "got a Tensor",
           r"Fix: max_grad_norm=2.0\.")
    expect(ValueError, lambda: gp.plan(mlp(), gp.Strategy(), (x4(),), max_grad_norm=-1.0),
           "max_grad_norm=-1.0 is invalid", "Fix:")


@case("E-compile-max-shapes")
def _():
    expect_untouched(ValueError, lambda m: compile_mse(m, max_shapes=0),
                     "max_shapes=0 is invalid: it must be a positive int, the number of input shapes",
                     r"Fix: max_shapes=8 \(the default\), or 1 to refuse any shape but the example's")
    expect(ValueError, lambda: compile_mse(mlp(), max_shapes=2.0), "max_shapes=2.0 is invalid", "Fix:")


@case("E-compile-empty-batch")
def _():
    expect_untouched(ValueError, lambda m: gp.compile(m, gp.Strategy(), (torch.randn(0, 4),)),
                     r"example_inputs: the batch is empty \(0 samples\)", "Fix: skip empty batches")
    pm = mse_pm()
    expect(ValueError, lambda: pm.train_step(torch.randn(0, 4), target=torch.randn(0, 2)),
           r"train_step: the batch is empty", "Fix:")


@case("E-compile-zero-optimizer")
def _():
    for optimizer, name in ((functools.partial(torch.optim.Adafactor, lr=1e-2), "Adafactor"),
                            (lambda params: type("MyAdam", (torch.optim.Adam,), {})(params), "MyAdam")):
        def compile_with(model, optimizer=optimizer):
            return gp.compile(model, gp.Strategy(zero=1), (x4(),), optimizer=optimizer)
        expect_untouched(ValueError, compile_with, rf"Strategy.zero=1 with optimizer \S*\.{name} is refused",
                         "elementwise", "SGD, Adam, AdamW", "Fix: use one of those optimizers, or zero=0")


@case("E-compile-zero-empty-rank")
def _(four_rank_refusals):
    expect_on_every_rank(four_rank_refusals.errors("E-compile-zero-empty-rank"), ValueError,
                         r"Strategy.zero=1 at dp=4 leaves dp rank 2 no element of any parameter", "Fix: use a smaller dp")


@case("E-compile-zero3-local-stages")
def _(four_rank_refusals):
    expect_on_every_rank(four_rank_refusals.errors("E-compile-zero3-local-stages"), ValueError,
                         r"Strategy.zero=3: the parameter 'shared.weight' is read by pipeline stages \[0, 2\], which all "
                         r"run on pp rank 0", "not built yet", "Fix: a partition that keeps its readers in one stage")



def _bn_net(**batch_norm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, **batch_norm), nn.ReLU(), nn.Linear(8, 2))


@case("E-compile-batch-norm-microbatches")
def _():
    model = _bn_net()
    expect(ValueError, lambda: gp.compile(model, gp.Strategy(microbatches=2), (x4(),),
                                          example_target=torch.randn(4, 2), loss_fn=F.mse_loss),
           r"Strategy\.microbatches=2 with batch norm '1' in training",
           "normalised with the statistics of its own rows", r"Fix: use microbatches=1, freeze the batch norms")
    model[1].eval()   # frozen: running statistics, the same for every microbatch
    gp.compile(model, gp.Strategy(microbatches=2), (x4(),), example_target=torch.randn(4, 2), loss_fn=F.mse_loss)


@case("E-compile-batch-norm-unsynced")
def _():
    from graphpar.frontend.compile import lower_rank
    expect(ValueError, lambda: lower_rank(_bn_net(track_running_stats=False), gp.Strategy(dp=2), (x4(),), rank=0,
                                          world_size=2, example_target=torch.randn(4, 2), loss_fn=F.mse_loss),
           r"Strategy\(dp=2\) with batch norm '1' kept as module code", "with their own statistics",
           r"Fix: track_running_stats=True with a momentum")

test_entry = entry_test(CASES)
