"""StepUndo in-process: take() before a real step, restore() after it gives back every parameter, optimizer state
tensor and value, param_group value, model buffer, GradScaler tensor and scheduler state bit for bit, and a step
from the restored state is the step the original state would have taken."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from mpiddp.elastic.undo import StepUndo, bytes_per_parameter, room_for


class Rebinding(torch.optim.Optimizer):
    """Momentum SGD that binds a new tensor to its state every step (as some third-party optimizers do) and keeps
    a plain counter in its state."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        for group in self.param_groups:
            for parameter in group["params"]:
                state = self.state[parameter]
                velocity = state.get("velocity", torch.zeros_like(parameter))
                state["velocity"] = 0.9 * velocity + parameter.grad
                state["count"] = state.get("count", 0) + 1
                parameter.add_(state["velocity"], alpha=-group["lr"])


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + index)
    return torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)


class Run:
    """A model, its optimizer, and where given its GradScaler and scheduler, trained step by step."""

    def __init__(self, optimizer: Callable, scaler: Callable | None = None, scheduler: Callable | None = None):
        self.model = make_model()
        self.optimizer = optimizer(self.model.parameters())
        self.scaler = scaler() if scaler else None
        self.scheduler = scheduler(self.optimizer) if scheduler else None

    def step(self, index: int) -> None:
        inputs, labels = batch(index)
        self.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(self.model(inputs), labels)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def undo(self) -> StepUndo:
        return StepUndo(self.model, self.optimizer, self.scaler, self.scheduler)

    def snapshot(self) -> dict:
        """Everything a step may change, copied, the optimizer state keyed by the parameter's position."""
        parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {index: {key: copied(value) for key, value in self.optimizer.state[p].items()}
                 for index, p in enumerate(parameters) if p in self.optimizer.state}
        return {"parameters": [p.detach().clone() for p in parameters], "state": state,
                "groups": [{key: copied(value) for key, value in group.items() if key != "params"}
                           for group in self.optimizer.param_groups],
                "buffers": {name: b.clone() for name, b in self.model.named_buffers()},
                "scaler": None if self.scaler is None else [copied(getattr(self.scaler, name, None))
                                                            for name in ("_scale", "_growth_tracker")],
                "scheduler": None if self.scheduler is None else copied(self.scheduler.state_dict())}


def copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copied(item) for item in value)
    return value


def identical(a: Any, b: Any) -> bool:
    """Bit for bit: tensors of the same dtype, shape, device and bytes; everything else equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.device == b.device
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(identical(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def fused_on_cpu(kind: type, **options: Any) -> Callable:
    """The optimizer fused on CPU, or a skip saying why torch does not have it."""
    probe = nn.Linear(2, 2)
    try:
        optimizer = kind(probe.parameters(), fused=True, **options)
        probe(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    except (RuntimeError, TypeError, ValueError) as error:
        pytest.skip(f"torch {torch.__version__} has no fused {kind.__name__} on CPU: {error}")
    return lambda params: kind(params, fused=True, **options)


def sgd(params: Any, **options: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-2, **options)


def adamw(params: Any, **options: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=1e-2, **options)


def sgd_options() -> dict:
    return {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-2}


OPTIMIZERS = {
    "sgd-foreach": lambda: (lambda params: sgd(params, foreach=True)),
    "sgd-fused": lambda: fused_on_cpu(torch.optim.SGD, **sgd_options()),
    "adamw-foreach": lambda: (lambda params: adamw(params, foreach=True)),
    "adamw-fused": lambda: fused_on_cpu(torch.optim.AdamW, lr=1e-2, weight_decay=1e-2),
    "adamw-amsgrad": lambda: (lambda params: adamw(params, amsgrad=True)),
    "adamw-tensor-lr": lambda: (lambda params: torch.optim.AdamW(params, lr=torch.tensor(1e-2))),
    "rebinding": lambda: Rebinding,
}


def round_trip(run: Run, twin: Run, warm: int, between: int = 1) -> None:
    """`warm` steps, take(), `between` steps (they change something), restore(): the state before, bit for bit;
    then one more step equals the step the twin (trained alike, never restored) takes from the same state."""
    for index in range(warm):
        run.step(index)
        twin.step(index)
    before = run.snapshot()
    assert identical(before, twin.snapshot())
    undo = run.undo()
    undo.take()
    for index in range(between):
        run.step(100 + index)
    assert not identical(run.snapshot(), before)
    undo.restore()
    assert identical(run.snapshot(), before)
    assert not undo.held
    run.step(warm)
    twin.step(warm)
    assert identical(run.snapshot(), twin.snapshot())


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("warm", [0, 2], ids=["first-step", "later-step"])
def test_a_step_undone_leaves_every_tensor_and_value_as_before(name, warm):
    optimizer = OPTIMIZERS[name]()
    round_trip(Run(optimizer), Run(optimizer), warm)


@pytest.mark.parametrize("name", ["sgd-foreach", "adamw-foreach", "rebinding"])
def test_several_steps_are_undone_alike(name):
    optimizer = OPTIMIZERS[name]()
    round_trip(Run(optimizer), Run(optimizer), warm=1, between=3)


def test_undoing_the_first_step_leaves_the_optimizer_without_state():
    run = Run(lambda params: adamw(params, foreach=True))
    undo = run.undo()
    undo.take()
    run.step(0)
    assert len(run.optimizer.state) == len(list(run.model.parameters()))
    undo.restore()
    assert len(run.optimizer.state) == 0


def test_a_rebinding_optimizer_holds_the_old_values_in_its_current_state():
    run = Run(Rebinding)
    run.step(0)
    first = run.model[0].weight
    before = run.optimizer.state[first]["velocity"].clone()
    undo = run.undo()
    undo.take()
    run.step(1)
    assert run.optimizer.state[first]["count"] == 2
    undo.restore()
    assert torch.equal(run.optimizer.state[first]["velocity"], before)
    assert run.optimizer.state[first]["count"] == 1


def cpu_scaler() -> torch.amp.GradScaler:
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    except (RuntimeError, TypeError) as error:
        pytest.skip(f"torch {torch.__version__} has no GradScaler on CPU: {error}")
    if not scaler.is_enabled():
        pytest.skip(f"torch {torch.__version__}: GradScaler('cpu') is disabled")
    return scaler


@pytest.mark.parametrize("warm", [0, 2], ids=["scale-not-created", "scale-created"])
def test_a_grad_scalers_scale_and_growth_tracker_are_undone(warm):
    cpu_scaler()
    optimizer = OPTIMIZERS["sgd-foreach"]()
    scaler = lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)  # noqa: E731
    run, twin = Run(optimizer, scaler=scaler), Run(optimizer, scaler=scaler)
    round_trip(run, twin, warm)
    assert run.scaler.get_scale() == twin.scaler.get_scale() > 2.0**10  # it grew, alike


def test_a_disabled_grad_scaler_is_left_alone():
    optimizer = OPTIMIZERS["sgd-foreach"]()
    scaler = lambda: torch.amp.GradScaler("cpu", enabled=False)  # noqa: E731
    round_trip(Run(optimizer, scaler=scaler), Run(optimizer, scaler=scaler), warm=1)


SCHEDULERS = {
    "step": lambda optimizer: lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
    "lambda": lambda optimizer: lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (epoch + 1)),
    "one-cycle": lambda optimizer: lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=20),
}


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("optimizer", ["sgd-foreach", "adamw-foreach"])
def test_a_schedulers_state_and_the_learning_rates_it_set_are_undone(name, optimizer):
    make = OPTIMIZERS[optimizer]()
    run, twin = Run(make, scheduler=SCHEDULERS[name]), Run(make, scheduler=SCHEDULERS[name])
    round_trip(run, twin, warm=2)
    assert "initial_lr" in run.optimizer.param_groups[0]


def test_batchnorm_buffers_changed_by_a_forward_are_undone():
    run = Run(OPTIMIZERS["sgd-foreach"]())
    run.step(0)
    before = run.snapshot()
    undo = run.undo()
    undo.take()
    run.model(batch(5)[0])  # train mode: running_mean, running_var, num_batches_tracked move
    assert not identical(run.snapshot()["buffers"], before["buffers"])
    undo.restore()
    assert identical(run.snapshot(), before)


def test_a_second_take_replaces_the_first():
    run = Run(OPTIMIZERS["adamw-foreach"]())
    run.step(0)
    undo = run.undo()
    undo.take()
    run.step(1)
    after_one = run.snapshot()
    undo.take()
    run.step(2)
    undo.restore()
    assert identical(run.snapshot(), after_one)


def test_restore_without_a_record_is_an_error():
    run = Run(OPTIMIZERS["sgd-foreach"]())
    undo = run.undo()
    with pytest.raises(RuntimeError, match="nothing to restore"):
        undo.restore()
    undo.take()
    assert undo.held
    undo.drop()
    assert not undo.held
    with pytest.raises(RuntimeError, match="nothing to restore"):
        undo.restore()
    undo.take()
    undo.restore()
    with pytest.raises(RuntimeError, match="nothing to restore"):  # a record is restored once
        undo.restore()


def test_the_copys_buffers_are_allocated_once_and_again_when_the_state_appears():
    run = Run(OPTIMIZERS["sgd-foreach"]())
    undo = run.undo()
    undo.take()
    parameters = len(list(run.model.parameters()))
    first = [buffer.data_ptr() for buffer in undo._buffers]
    run.step(0)  # creates the momentum buffers: more tensors to copy
    undo.drop()
    undo.take()
    second = [buffer.data_ptr() for buffer in undo._buffers]
    assert len(second) == len(first) + parameters
    assert second[:parameters] == first[:parameters]  # the parameters' buffers are kept
    run.step(1)
    undo.take()
    assert [buffer.data_ptr() for buffer in undo._buffers] == second


def test_device_bytes_count_the_parameters_and_the_state_to_come():
    run = Run(OPTIMIZERS["sgd-foreach"]())
    parameter_bytes = sum(p.numel() * p.element_size() for p in run.model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in run.model.buffers())
    undo = run.undo()
    assert bytes_per_parameter(run.optimizer) == 8.0  # fp32 parameter and its momentum
    assert undo.device_bytes() == 2 * parameter_bytes + buffer_bytes
    run.step(0)
    assert undo.device_bytes() == 2 * parameter_bytes + buffer_bytes
    adam = Run(OPTIMIZERS["adamw-foreach"]())
    assert bytes_per_parameter(adam.optimizer) == 12.0
    adam.step(0)
    assert 12.0 < bytes_per_parameter(adam.optimizer) < 13.0  # and a 4-byte step count per parameter tensor


def test_room_for_is_none_on_cpu_and_says_why_where_a_gpu_lacks_room(monkeypatch):
    run = Run(OPTIMIZERS["sgd-foreach"]())
    undo = run.undo()
    assert room_for(undo) is None
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(undo, "bytes_by_device", lambda: {gpu: 10 * 2**30})
    monkeypatch.setattr(undo, "held_bytes", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (20 * 2**30, 80 * 2**30))
    assert room_for(undo) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (12 * 2**30, 80 * 2**30))
    reason = room_for(undo)  # 10 GiB needed, 12 free, 4 kept spare
    assert reason is not None and "cuda:0" in reason and "10.00 GiB" in reason and "12.00 GiB" in reason
    monkeypatch.setattr(undo, "held_bytes", lambda device: 10 * 2**30)  # the copy is allocated already
    assert room_for(undo) is None


def test_a_model_or_optimizer_of_the_wrong_kind_is_a_value_error():
    with pytest.raises(ValueError, match="torch.nn.Module"):
        StepUndo(object(), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="torch optimizer"):
        StepUndo(nn.Linear(2, 2), object())  # type: ignore[arg-type]


def test_state_rebound_to_another_shape_or_dropped_is_bound_again_to_the_old_values():
    run = Run(Rebinding)
    run.step(0)
    first, second = run.model[0].weight, run.model[0].bias
    before = run.snapshot()
    undo = run.undo()
    undo.take()
    run.step(1)
    run.optimizer.state[first]["velocity"] = torch.zeros(1, dtype=torch.float64)  # another shape and dtype
    del run.optimizer.state[second]["velocity"]
    undo.restore()
    assert identical(run.snapshot(), before)


def test_take_never_makes_the_cpu_wait_for_the_device(monkeypatch):
    """What would synchronise with a GPU (a tensor's value read on the CPU, a device synchronise) fails in take()."""
    make = OPTIMIZERS["adamw-tensor-lr"]()
    run = Run(make, scaler=cpu_scaler, scheduler=SCHEDULERS["step"])
    run.step(0)
    undo = run.undo()

    def synchronises(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("take() waited for the device")

    for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, synchronises)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronises)
    undo.take()
    undo.take()
    monkeypatch.undo()
    assert undo.held and len(undo._buffers) > len(list(run.model.parameters()))


def test_the_step_wrappers_optimizer_is_undone_as_its_own(solo_group):
    """Over mpiddp.Optimizer (param_groups and state are the wrapped optimizer's), with the model inside
    mpiddp.DistributedDataParallel: what the trainer and a script hand to StepUndo."""
    from mpiddp import DistributedDataParallel, Optimizer

    model = make_model()
    wrapped = DistributedDataParallel(model)
    optimizer = Optimizer(adamw(wrapped.parameters(), foreach=True), wrapped)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(wrapped(batch(0)[0]), batch(0)[1]).backward()
        optimizer.step()

    def snapshot() -> dict:
        return copied({"parameters": list(model.parameters()), "buffers": dict(model.named_buffers()),
                       "state": {index: optimizer.state[p] for index, p in enumerate(model.parameters())}})

    step()
    before = snapshot()
    undo = StepUndo(wrapped, optimizer)
    undo.take()
    step()
    assert not identical(snapshot(), before)
    undo.restore()
    assert identical(snapshot(), before)
