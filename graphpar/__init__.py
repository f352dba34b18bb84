"""graphpar: compiled graph partitioning for PyTorch training.

    import graphpar as gp
    pm = gp.compile(model, gp.Strategy(dp=2, tp=2, pp=2), example_inputs=(x,), loss_fn=...)
    loss = pm.train_step(x, target=y)

See docs/architecture.md for the data flow and docs/strategy.md for the options.
"""
from graphpar.strategy import Strategy
from graphpar.frontend.compile import compile, lower_rank
from graphpar.runtime.module import ParallelModule, StepMismatchError
from graphpar.passes.manager import Pass, PassContext, list_passes, register_pass, unregister_pass
from graphpar.distributed.launch import LaunchError, launch
from graphpar.planner import auto
from graphpar.planner.plan import Report, plan
from graphpar.tools.verify import VerifyReport, verify

# pm.report() runs the planner, which the runtime below it cannot import: wired here, where
# every floor is visible (docs/architecture.md, "Layering").
ParallelModule.planner = staticmethod(plan)

__all__ = ["Strategy", "compile", "lower_rank", "ParallelModule", "StepMismatchError", "Pass", "PassContext", "list_passes",
           "register_pass", "unregister_pass", "launch", "LaunchError", "plan", "Report", "verify",
           "VerifyReport", "auto"]
__version__ = "0.1.0"
