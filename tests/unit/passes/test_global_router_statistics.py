"""Which nodes global_router_statistics takes for the load-balancing loss's: torch.export
writes a node's stack trace in two forms (ending at the line that calls
load_balancing_loss_func, or going on into its frame); both must be found, in either order
of tests (the second form once made the pass miss the loss and E-router-statistics-form pass
silently when the suite ran in another order)."""
import pytest
import torch.fx

from passes.global_router_statistics import LOSS_FUNCTION, _called_from

CALLER = ('File "model.py", line 40, in forward\n'
          '    aux_loss = load_balancing_loss_func(outputs.router_logits, self.num_experts)')
INSIDE = CALLER + ('\n  File "model.py", line 12, in load_balancing_loss_func\n'
                   '    tokens_per_expert = torch.mean(expert_mask.float(), dim=0)')
DEEPER = INSIDE + ('\n  File "functional.py", line 7, in one_hot\n'
                   '    return torch._C._nn.one_hot(tensor, num_classes)')
ELSEWHERE = 'File "model.py", line 38, in forward\n    hidden = self.norm(hidden)'


def _node(stack_trace):
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["stack_trace"] = stack_trace
    return node


@pytest.mark.parametrize("stack_trace", [CALLER, INSIDE, DEEPER], ids=["caller-line", "own-frame", "deeper-call"])
def test_nodes_of_the_call_are_found_in_every_form_of_the_stack_trace(stack_trace):
    assert _called_from(_node(stack_trace), LOSS_FUNCTION)


@pytest.mark.parametrize("stack_trace", [ELSEWHERE, "", None], ids=["other-code", "empty", "absent"])
def test_other_nodes_are_not(stack_trace):
    assert not _called_from(_node(stack_trace), LOSS_FUNCTION)
