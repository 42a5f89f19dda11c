"""mpiddp.Optimizer(..., commit="late") in-process (no MPI, every agreement yes): what a script may do to its
optimizer between two steps while one is held, and what a rollback after it then puts back."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mpiddp.elastic.api import Manager


class AgreeingManager(Manager):
    """A process's Manager whose job recovers in the job, with no MPI: every collective completes, every member
    agrees."""

    def __init__(self) -> None:
        super().__init__()
        members = SimpleNamespace(wait=lambda work: work.wait(), all_completed=lambda completed: completed,
                                  failed=lambda: None, lost_at=None)
        self.recovery = SimpleNamespace(members=members, current_members=members, awaiting_join=False, loop=None,
                                        at_commit=lambda state: None,
                                        grower=SimpleNamespace(offered=False))  # type: ignore[assignment]

    def enabled(self, min_world_size=None):  # type: ignore[no-untyped-def]
        return self.recovery


@pytest.fixture
def late(solo_group, monkeypatch):
    """A model and its mpiddp.Optimizer committing late, one step taken strictly and one held."""
    from mpiddp.elastic import steps

    monkeypatch.setattr(steps, "current", lambda: object())
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ddp = steps.DistributedDataParallel(model, manager=AgreeingManager())
    optimizer = steps.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ddp, commit="late")
    for _ in range(2):
        optimizer.zero_grad()
        ddp(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
    assert optimizer._late is not None and optimizer._late.holding
    return model, optimizer


def test_a_param_group_added_while_a_step_is_held_does_not_break_the_rollback(late):
    """Unfreezing a layer mid-run (add_param_group) while a step is held: a failure at the next agreement rolls the
    held step back on every survivor. It must recover, not raise out of StepUndo.restore() (the group count
    changed since take())."""
    _, optimizer = late
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "lr": 0.01})
    optimizer.roll_back_held()  # what _skip_and_recover does on every survivor after a failed agreement
    assert len(optimizer.param_groups) == 2  # the script's own change is kept


def test_a_state_dict_loaded_while_a_step_is_held_is_not_overwritten_by_a_rollback(late):
    """A script loads a state (a checkpoint) between two steps: a later rollback of the step held before the load
    must not put the pre-load values back over it."""
    model, optimizer = late
    loaded = {name: torch.full_like(value, 7.0) for name, value in model.state_dict().items()}
    saved = optimizer.state_dict()
    model.load_state_dict(loaded)
    optimizer.load_state_dict(saved)
    optimizer.roll_back_held()
    assert all(torch.equal(value, loaded[name]) for name, value in model.state_dict().items())
