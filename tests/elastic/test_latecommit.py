"""The late commit's state machine (mpiddp.elastic.latecommit), driven in process: works that complete or whose
wait reports a lost member, agreements that say yes or no, the real undo record over a real model and optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpiddp.elastic.latecommit import LateCommit, late_refusal
from mpiddp.elastic.membership import MembersLost
from mpiddp.elastic.undo import StepUndo


class Work:
    """A torch work as the commit sees it: waited for through the members."""

    def __init__(self, lost: tuple[int, ...] | None = None) -> None:
        self.lost = lost
        self.waited = False


class Members:
    """The failure watch and the agreement, scripted: `answers` are the other members' votes (True: they
    completed), one per agreement; the agreement is the AND with this rank's."""

    def __init__(self, answers: list[bool] | None = None) -> None:
        self.answers = list(answers or [])
        self.votes: list[bool] = []
        self.lost_at: float | None = None

    def wait(self, work: Work) -> None:
        work.waited = True
        if work.lost is not None:
            self.lost_at = 1.0
            raise MembersLost(work.lost, 1.0)

    def all_completed(self, completed: bool) -> bool:
        self.votes.append(completed)
        others = self.answers.pop(0) if self.answers else True
        return completed and others

    def failed(self) -> tuple[int, ...] | None:
        return (3,)


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def backward(model: nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    model(torch.randn(16, 6, generator=generator)).pow(2).mean().backward()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [*model.state_dict().values()]
    for state in optimizer.state.values():
        tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return [tensor.detach().clone() for tensor in tensors]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def late_steps(model: nn.Module, optimizer: torch.optim.Optimizer, commit: LateCommit, steps: range,
               lost_at: int | None = None) -> list[list[torch.Tensor]]:
    """The step wrappers' loop, late: agree on the held step, hold this one, step. Returns the state before each
    step; stops (after rolling back) at the first agreement that says no."""
    before = []
    for step in steps:
        optimizer.zero_grad()
        backward(model, step)
        if not commit.agree():
            commit.roll_back()
            break
        before.append(snapshot(model, optimizer))
        commit.hold([Work(lost=(1,) if step == lost_at else None)])
        optimizer.step()
    return before


def test_without_a_failure_the_late_commit_trains_bit_for_bit_as_the_strict_wait() -> None:
    strict_model, strict_optimizer = trained()
    for step in range(12):
        strict_optimizer.zero_grad()
        backward(strict_model, step)
        strict_optimizer.step()
    model, optimizer = trained()
    members = Members()
    commit = LateCommit(members, StepUndo(model, optimizer))
    late_steps(model, optimizer, commit, range(12))
    commit.settle()
    assert not commit.holding
    assert same(snapshot(model, optimizer), snapshot(strict_model, strict_optimizer))
    assert members.votes == [True] * 12  # one agreement a step (11 at the next step, the last at the settle)


def test_a_step_whose_all_reduce_lost_a_member_is_undone_at_the_next_agreement() -> None:
    model, optimizer = trained()
    members = Members()
    commit = LateCommit(members, StepUndo(model, optimizer))
    before = late_steps(model, optimizer, commit, range(10), lost_at=6)
    assert len(before) == 7  # steps 0-6 taken; step 7's agreement found step 6's all-reduce lost
    assert members.votes[-1] is False
    assert same(snapshot(model, optimizer), before[6])  # the state before step 6, as on every survivor
    assert commit.lost is not None and commit.lost.ranks == (1,)
    assert not commit.holding


def test_a_member_that_failed_elsewhere_makes_every_survivor_undo_the_held_step() -> None:
    model, optimizer = trained()
    members = Members(answers=[True] * 4 + [False])  # another member did not complete step 4
    commit = LateCommit(members, StepUndo(model, optimizer))
    before = late_steps(model, optimizer, commit, range(10))
    assert len(before) == 5 and members.votes[-1] is True  # this rank completed: the others' word counts
    assert same(snapshot(model, optimizer), before[4])
    assert commit.lost is None and commit.members_lost().ranks == (3,)


def test_a_failure_noticed_outside_the_commit_rolls_the_held_step_back_and_settle_reports_it() -> None:
    """The trainer's stop agreement or a metric line's reduction raises: the survivors roll back what they hold.
    After a strict settle nothing is held, and nothing is rolled back."""
    model, optimizer = trained()
    commit = LateCommit(Members(), StepUndo(model, optimizer))
    before = late_steps(model, optimizer, commit, range(5))
    assert commit.holding
    assert commit.roll_back() is True
    assert same(snapshot(model, optimizer), before[-1])
    late_steps(model, optimizer, commit, range(5, 8))
    commit.settle()
    settled = snapshot(model, optimizer)
    assert commit.roll_back() is False
    assert same(snapshot(model, optimizer), settled)
    commit.hold([Work(lost=(2,))])
    optimizer.step()
    with pytest.raises(MembersLost) as lost:
        commit.settle()
    assert lost.value.ranks == (2,)
    assert commit.roll_back() is True and same(snapshot(model, optimizer), settled)


def test_nothing_held_and_nothing_lost_exchanges_nothing_but_a_lost_step_is_agreed_on() -> None:
    model, optimizer = trained()
    members = Members()
    commit = LateCommit(members, StepUndo(model, optimizer))
    assert commit.agree() is True and members.votes == []
    assert commit.agree(completed_since=False) is False and members.votes == [False]


@pytest.mark.parametrize(("mode", "device", "room", "late"), [
    ("auto", "cuda", None, True), ("auto", "cpu", None, False), ("late", "cpu", None, True),
    ("strict", "cuda", None, False), ("auto", "cuda", "no room", False), ("late", "cuda", "no room", False)])
def test_which_commit_mode_is_in_force(mode: str, device: str, room: str | None, late: bool) -> None:
    assert (late_refusal(mode, device, room) is None) is late


def test_an_unknown_commit_mode_is_one_line() -> None:
    with pytest.raises(ValueError, match="commit mode 'lazy': one of auto, late, strict"):
        late_refusal("lazy", "cpu", None)
