"""graphpar: compiled graph partitioning for PyTorch training.

    import graphpar as gp
    pm = gp.compile(model, gp.Strategy(dp=2, tp=2, pp=2), example_inputs=(x,), loss_fn=...)
    loss = pm.train_step(x, target=y)

See docs/architecture.md for the data flow and docs/strategy.md for the options.
"""
from graphpar.strategy import Strategy
from graphpar.compile import compile, lower_rank
from graphpar.module import ParallelModule, StepMismatchError
from graphpar.pipeline import Pass, PassContext, list_passes, register_pass, unregister_pass
from graphpar.launch import LaunchError, launch
from graphpar.plan import Report, plan
from graphpar.verify import VerifyReport, verify

__all__ = ["Strategy", "compile", "lower_rank", "ParallelModule", "StepMismatchError", "Pass", "PassContext", "list_passes",
           "register_pass", "unregister_pass", "launch", "LaunchError", "plan", "Report", "verify",
           "VerifyReport"]
__version__ = "0.1.0"
