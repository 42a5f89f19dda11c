"""mpiddp.DistributedDataParallel and mpiddp.Optimizer in-process, without a job: torch's DDP and the optimizer
unchanged (torchrun runs the same script), the attributes a torchrun-style loop uses forwarded."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mpiddp import DistributedDataParallel, Optimizer
from mpiddp.elastic.api import Manager


@pytest.fixture
def wrapped(solo_group):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ddp = DistributedDataParallel(model)
    return model, ddp, Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9), ddp)


def test_without_a_job_the_wrappers_train_as_torchs_own(wrapped):
    model, ddp, optimizer = wrapped
    assert isinstance(ddp.ddp, nn.parallel.DistributedDataParallel) and ddp.module is model
    assert ddp.watch is None  # no mpiddp job: no recovery, torch's own all-reduce
    reference = nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    plain = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    inputs = torch.randn(8, 4)
    for _ in range(3):
        for net, opt in ((ddp, optimizer), (reference, plain)):
            opt.zero_grad()
            net(inputs).pow(2).mean().backward()
            opt.step()
    assert torch.equal(model.weight, reference.weight) and (optimizer.steps, optimizer.skipped) == (3, 0)


def test_the_attributes_a_torchrun_loop_uses_are_torchs(wrapped):
    model, ddp, optimizer = wrapped
    assert list(ddp.state_dict()) == ["module.weight", "module.bias"]  # as torch's DDP saves it
    ddp.require_backward_grad_sync = False  # nanoGPT's gradient accumulation
    assert ddp.ddp.require_backward_grad_sync is False and ddp.require_backward_grad_sync is False
    with ddp.no_sync():
        ddp(torch.randn(2, 4)).sum().backward()
    assert optimizer.param_groups[0]["lr"] == 0.5 and optimizer.defaults["momentum"] == 0.9
    optimizer.param_groups[0]["lr"] = 0.1  # a scheduler's write reaches the optimizer itself
    assert optimizer.optimizer.param_groups[0]["lr"] == 0.1
    assert ddp.broadcast_buffers is True  # anything else: torch's wrapper


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="this torch has no device-generic GradScaler")
def test_grad_scaler_steps_through_the_wrapper(wrapped):
    _, ddp, optimizer = wrapped
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    scaler.scale(ddp(torch.randn(8, 4)).pow(2).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert optimizer.steps == 1


def test_the_optimizer_wraps_mpiddps_model_only(solo_group):
    model = nn.Linear(4, 2)
    torch_ddp = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(TypeError, match="must be an mpiddp.DistributedDataParallel"):
        Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), torch_ddp)


def test_the_global_batch_is_split_over_the_ranks_there_are_now(solo_group):
    from mpiddp import split_global_batch

    assert split_global_batch(64, 16) == (16, 4)  # one rank: the per-rank batch kept, the accumulation grows
    assert split_global_batch(12, 5) == (4, 3)  # the largest per-rank batch below 5 that divides
    with pytest.raises(ValueError, match="at least 1"):
        split_global_batch(0, 8)


def test_schedulers_and_a_fused_optimizers_grad_scaler_see_the_optimizer_itself(solo_group):
    """LR schedulers take the wrapper (a torch Optimizer to them); GradScaler's grad_scale and found_inf reach a
    fused optimizer, so its updates are unscaled as without the wrapper."""
    if not hasattr(torch.amp, "GradScaler") or "fused" not in torch.optim.SGD.__init__.__code__.co_varnames:
        pytest.skip("this torch has no fused SGD or no device-generic GradScaler")
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        ddp = DistributedDataParallel(model)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
        optimizer = Optimizer(inner, ddp) if wrap else inner
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(ddp(torch.ones(3, 4)).pow(2).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        results.append((model.weight.detach().clone(), inner.param_groups[0]["lr"]))
    assert torch.allclose(results[0][0], results[1][0]) and results[0][1] == results[1][1] == 0.05


class RecoveringManager(Manager):
    """A process's Manager whose job recovers in the job, with no MPI: every collective completes."""

    def __init__(self) -> None:
        super().__init__()
        members = SimpleNamespace(wait=lambda work: work.wait())
        self.recovery = SimpleNamespace(members=members, current_members=members,
                                        awaiting_join=False, loop=None, at_commit=lambda state: None,
                                        grower=SimpleNamespace(offered=False))  # type: ignore

    def enabled(self, min_world_size=None):  # type: ignore[no-untyped-def]
        return self.recovery


@pytest.fixture
def under_recovery(solo_group, monkeypatch):
    """mpiddp's wrapper as under in-job recovery (its watched hook and buffer broadcast), with no MPI: the wrapper
    class of elastic.steps, handed a Manager of its own."""
    from mpiddp.elastic import steps

    monkeypatch.setattr(steps, "current", lambda: object())
    manager = RecoveringManager()
    return lambda module: steps.DistributedDataParallel(module, manager=manager)


def test_under_recovery_the_wrapper_turns_ddps_buffer_sync_off_without_torchs_deprecation_warning(under_recovery):
    """The wrapper broadcasts the buffers itself, watched: torch's own sync before each forward is off, by the name
    this torch takes (`forward_sync_buffers` from 2.13, where `broadcast_buffers` warns on every rank)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch 2.13+: "`broadcast_buffers` is deprecated"
        ddp = under_recovery(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert ddp._watched_buffers and ddp.ddp.broadcast_buffers is False


def test_the_buffer_sync_is_turned_off_by_the_name_the_torch_takes():
    from mpiddp.elastic.steps import _forward_sync_off

    new, old = {"module": None, "forward_sync_buffers": None}, {"module": None, "broadcast_buffers": None}
    assert _forward_sync_off({}, new) == ({"forward_sync_buffers": False}, True)
    assert _forward_sync_off({"broadcast_buffers": True}, new) == ({"forward_sync_buffers": False}, True)
    assert _forward_sync_off({}, old) == ({"broadcast_buffers": False}, True)  # torch before 2.13
    # the user's own choice of no sync: left as given, nothing to watch
    assert _forward_sync_off({"broadcast_buffers": False}, new) == ({"broadcast_buffers": False}, False)
    assert _forward_sync_off({"forward_sync_buffers": False}, new) == ({"forward_sync_buffers": False}, False)
    assert _forward_sync_off({"broadcast_buffers": False, "forward_sync_buffers": True}, new) == \
        ({"forward_sync_buffers": False}, True)  # torch's rule: the new name wins


def test_the_public_wrapper_is_handed_the_processs_one_manager(solo_group, monkeypatch):
    """mpiddp.DistributedDataParallel passes the process's Manager (mpiddp.script.recovery) to elastic's wrapper,
    which keeps it there for a recovery to rebuild; mpiddp.Optimizer finds it on the wrapper it trains."""
    from mpiddp.elastic import steps
    from mpiddp.script import recovery

    manager = Manager()
    monkeypatch.setattr(recovery, "_manager", manager)
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    optimizer = Optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
    assert isinstance(ddp, steps.DistributedDataParallel) and ddp.manager is manager
    assert manager.live_models() == [ddp] and optimizer._generation == manager.generation == 0
    other = steps.DistributedDataParallel(nn.Linear(4, 2), manager=Manager())  # another process's, as it were
    assert manager.live_models() == [ddp] and other.manager is not manager


def test_the_whole_wrapper_and_its_optimizer_save_and_copy_as_torchs_do(wrapped):
    """torch.save of the whole wrapper (or of the optimizer over it) and copy.deepcopy work as for torch's own: the
    process's in-job recovery holds references of this process only and is left out; a copy is handed the loading
    process's."""
    import copy
    import io

    from mpiddp.script.recovery import manager

    model, ddp, optimizer = wrapped
    for thing in (ddp, optimizer):
        buffer = io.BytesIO()
        torch.save(thing, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        loaded_ddp = loaded if thing is ddp else loaded.model
        assert loaded_ddp.manager is manager() and torch.equal(loaded_ddp.module.weight, model.weight)
    duplicate = copy.deepcopy(ddp)
    assert duplicate.manager is ddp.manager is manager() and duplicate.module is not model
