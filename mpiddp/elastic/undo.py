"""The undo record of one optimizer step: what lets a GPU commit each step one step late.

In-job recovery must leave every survivor of a failed rank with the same model. Waiting for a step's all-reduces
before its optimizer step (to know that every rank completed it) costs a stall of the GPU's queue each step. Instead
the step is queued at once, and whether it counts is agreed at the next step: before `optimizer.step()` the
trainer calls `StepUndo.take()`, which copies everything the step will change (the parameters, the optimizer's
state and its param_groups' values, the model's buffers, a GradScaler's scale, a scheduler's state); at the next
step, once the ranks agreed that none failed, `drop()`; where one failed, every survivor calls `restore()` and
holds the same pre-step values again, bit for bit.

Cost: `take()` copies on the device into buffers allocated once (again only when the set of tensors, their shapes
or dtypes change, as at the first step, which creates the optimizer's state), with one `torch._foreach_copy_` per
(device, dtype), issued on the current stream: it runs after whatever the stream holds, without making the CPU
wait. `take()` never synchronises; `restore()` runs after the caller synchronised the device. The copy holds as
many bytes as the parameters and the optimizer state together (SGD with momentum: twice the parameters, AdamW:
three times): `room_for()` says where that does not fit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

# GradScaler's tensors that its update() changes in place; created lazily at the first scale()
_SCALER_TENSORS = ("_scale", "_growth_tracker")
# free device memory left over after the copy: the allocator's fragmentation and a step's own peaks need room
_MARGIN_FRACTION = 0.05
_MARGIN_MIN_BYTES = 256 * 2**20


class _Slot(NamedTuple):
    """Where one copied tensor lives: `kind` is param (owner: the parameter), state (owner: the parameter, key:
    the state's key), group (owner: the group's index, key: its key), buffer (owner: the buffer's name) or scaler
    (key: the GradScaler attribute). A tuple: take() makes hundreds of them every step."""

    kind: str
    owner: Any = None
    key: Any = None


def _copy_into(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """One kernel launch for a whole (device, dtype) group where torch has the foreach copy (torch >= 2.1)."""
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(destinations, sources)
    else:
        for destination, source in zip(destinations, sources):
            destination.copy_(source)


def _copied(value: Any) -> Any:
    """A copy of containers (so a later in-place change of the live one leaves it alone) and of tensors; other
    values (numbers, strings, functions) as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        copy = value.copy()  # the same kind of dict (an OrderedDict, a defaultdict with its factory)
        for key, item in value.items():
            copy[key] = _copied(item)
        return copy
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_copied(item) for item in value)
    return value


def _fits(current: Any, saved: torch.Tensor) -> bool:
    """Whether the saved values can be written back into the live tensor in place."""
    return (isinstance(current, torch.Tensor) and current.shape == saved.shape and current.dtype == saved.dtype
            and current.device == saved.device)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _layout(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.dtype, tensor.shape, tensor.stride())


def _state_tensors_per_parameter(optimizer: torch.optim.Optimizer) -> int:
    """How many parameter-sized tensors torch's optimizers keep per parameter once they stepped (the state they
    create at their first step); 0 for an optimizer this does not know."""
    defaults = getattr(optimizer, "defaults", {})
    optim = torch.optim
    if isinstance(optimizer, optim.SGD):
        return int(any(group.get("momentum", 0) for group in optimizer.param_groups))
    if isinstance(optimizer, (optim.Adam, optim.AdamW)):
        return 2 + int(bool(defaults.get("amsgrad")))
    if isinstance(optimizer, (optim.Adamax, optim.NAdam, optim.RAdam, optim.Adadelta, optim.Rprop)):
        return 2
    if isinstance(optimizer, optim.RMSprop):
        return 1 + int(bool(defaults.get("momentum"))) + int(bool(defaults.get("centered")))
    if isinstance(optimizer, optim.Adagrad):
        return 1
    return 0


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters of every param_group, each once."""
    seen: set[int] = set()
    parameters = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if id(parameter) not in seen:
                seen.add(id(parameter))
                parameters.append(parameter)
    return parameters


def _state_to_come(optimizer: torch.optim.Optimizer) -> dict[torch.device, int]:
    """Bytes of the state the optimizer creates at its first step for parameters that have none yet, by device."""
    per_parameter = _state_tensors_per_parameter(optimizer)
    to_come: dict[torch.device, int] = {}
    for parameter in _parameters(optimizer):
        if not optimizer.state.get(parameter):
            to_come[parameter.device] = to_come.get(parameter.device, 0) + per_parameter * _nbytes(parameter)
    return to_come


def bytes_per_parameter(optimizer: torch.optim.Optimizer) -> float:
    """Bytes the undo copy holds per parameter element for the parameters and state of `optimizer`: the state it
    holds, or for a parameter without state yet, what torch's optimizer creates at its first step (fp32 SGD with
    momentum: 8, AdamW: 12). Buffers, a scaler's scale and the scheduler come on top (small)."""
    elements = held = 0
    for parameter in _parameters(optimizer):
        elements += parameter.numel()
        held += _nbytes(parameter)
        state = optimizer.state.get(parameter) or {}
        held += sum(_nbytes(value) for value in state.values() if isinstance(value, torch.Tensor))
    held += sum(_state_to_come(optimizer).values())
    return held / elements if elements else 0.0


class StepUndo:
    """The undo record of one optimizer step of `optimizer` over `model` (with its GradScaler and LR scheduler,
    where used): `take()` before `optimizer.step()`, then `drop()` once the step is committed, or `restore()` to
    put back exactly what `take()` saw. Not thread-safe; one per optimizer."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None = None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"StepUndo(model, ...): model must be a torch.nn.Module, not {type(model).__name__}")
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "state"):
            raise ValueError(f"StepUndo(model, optimizer): optimizer must be a torch optimizer, not "
                             f"{type(optimizer).__name__}")
        self.model, self.optimizer, self.scaler, self.scheduler = model, optimizer, scaler, scheduler
        self._held = False
        self._slots: list[_Slot] = []
        self._buffers: list[torch.Tensor] = []  # the copies, slot for slot, kept from one take() to the next
        self._layouts: list[tuple] = []
        self._groups: list[tuple[list[torch.Tensor], list[int]]] = []  # per (device, dtype): buffers, slot indices
        self._state_entries: list[tuple[torch.Tensor, tuple, dict]] = []  # parameter, keys, non-tensor values
        self._group_values: list[dict] = []  # each param_group's non-tensor values
        self._group_keys: list[tuple] = []
        self._scaler_absent: tuple[str, ...] = ()
        self._scheduler_state: dict | None = None

    @property
    def held(self) -> bool:
        """Whether a copy is held: taken and neither restored nor dropped since."""
        return self._held

    def take(self) -> None:
        """Copy what the next `optimizer.step()` (and the scaler's update, the scheduler's step, a forward in train
        mode) will change. A record already held is replaced. Issued on the current stream; never synchronises."""
        slots, sources = self._sources()
        self._prepare(sources)
        with torch.no_grad():
            for destinations, indices in self._groups:
                _copy_into(destinations, [sources[index] for index in indices])
        self._slots = slots
        self._take_values()
        self._held = True

    def drop(self) -> None:
        """The step is committed: forget the copy (its buffers stay for the next `take()`)."""
        self._held = False
        self._slots, self._state_entries, self._group_values, self._scheduler_state = [], [], [], None

    def restore(self) -> None:
        """Put back exactly what `take()` saw, bit for bit; the record is then spent. Its copies are issued on the
        current stream, behind the step they undo (never a sync: after a failure they may be queued behind an
        all-reduce that runs only once NCCL is aborted). RuntimeError where nothing is held."""
        if not self._held:
            raise RuntimeError("StepUndo.restore(): nothing to restore (no take() since the last restore() or "
                               "drop())")
        if len(self.optimizer.param_groups) != len(self._group_values):
            raise RuntimeError(f"StepUndo.restore(): the optimizer has {len(self.optimizer.param_groups)} "
                               f"param_groups, it had {len(self._group_values)} at take()")
        with torch.no_grad():
            self._restore_state_entries()
            self._restore_group_values()
            for slot, saved in zip(self._slots, self._buffers):
                self._put_back(slot, saved)
        if self.scaler is not None:
            for attribute in self._scaler_absent:
                setattr(self.scaler, attribute, None)
        if self.scheduler is not None and self._scheduler_state is not None:
            self.scheduler.load_state_dict(_copied(self._scheduler_state))
        self._held = False

    def bytes_by_device(self) -> dict[torch.device, int]:
        """What `device_bytes()` counts, by device."""
        by_device: dict[torch.device, int] = {}
        for tensor in self._sources()[1]:
            by_device[tensor.device] = by_device.get(tensor.device, 0) + _nbytes(tensor)
        for device, size in _state_to_come(self.optimizer).items():
            by_device[device] = by_device.get(device, 0) + size
        return by_device

    def device_bytes(self) -> int:
        """Bytes the copy holds, on whichever devices the tensors live: the parameters, the optimizer's state (before
        its first step, what the optimizer will create), the model's buffers and the scaler's tensors."""
        return sum(self.bytes_by_device().values())

    def held_bytes(self, device: torch.device) -> int:
        """Bytes of the buffers allocated on `device` so far."""
        return sum(_nbytes(buffer) for buffer in self._buffers if buffer.device == device)

    def _sources(self) -> tuple[list[_Slot], list[torch.Tensor]]:
        """Every tensor the step may change, and where it lives, in a fixed order."""
        slots: list[_Slot] = []
        sources: list[torch.Tensor] = []
        parameters = _parameters(self.optimizer)
        for parameter in parameters:
            slots.append(_Slot("param", parameter))
            sources.append(parameter)
        for parameter in parameters:
            for key, value in (self.optimizer.state.get(parameter) or {}).items():
                if isinstance(value, torch.Tensor):
                    slots.append(_Slot("state", parameter, key))
                    sources.append(value)
        for index, group in enumerate(self.optimizer.param_groups):
            for key, value in group.items():
                if key != "params" and isinstance(value, torch.Tensor):  # lr as a tensor
                    slots.append(_Slot("group", index, key))
                    sources.append(value)
        for name, buffer in self.model.named_buffers():
            slots.append(_Slot("buffer", name))
            sources.append(buffer)
        if self.scaler is not None and self.scaler.is_enabled():
            for attribute in _SCALER_TENSORS:
                value = getattr(self.scaler, attribute, None)
                if isinstance(value, torch.Tensor):
                    slots.append(_Slot("scaler", key=attribute))
                    sources.append(value)
        return slots, sources

    def _prepare(self, sources: list[torch.Tensor]) -> None:
        """Buffers for `sources`: the ones held where every tensor's layout is unchanged; else a buffer of the right
        layout for each, reusing the held ones that fit (the first step adds the optimizer's state, the parameters'
        buffers stay), and the (device, dtype) groups of one foreach copy each."""
        layouts = [_layout(source) for source in sources]
        if layouts == self._layouts:
            return
        spare: dict[tuple, list[torch.Tensor]] = {}
        for layout, buffer in zip(self._layouts, self._buffers):
            spare.setdefault(layout, []).append(buffer)
        self._buffers, self._layouts, self._groups = [], [], []  # the ones not reused are freed as they go
        buffers = []
        for layout, source in zip(layouts, sources):
            reused = spare.get(layout)
            buffers.append(reused.pop(0) if reused else torch.empty_like(source, memory_format=torch.preserve_format))
        spare.clear()
        by_kind: dict[tuple, tuple[list[torch.Tensor], list[int]]] = {}
        for index, buffer in enumerate(buffers):
            destinations, indices = by_kind.setdefault((buffer.device, buffer.dtype), ([], []))
            destinations.append(buffer)
            indices.append(index)
        self._buffers, self._layouts, self._groups = buffers, layouts, list(by_kind.values())

    def _take_values(self) -> None:
        """The non-tensor part: which parameters have state and which keys, plain state values, param_group values,
        the scaler's tensors not created yet, the scheduler's state."""
        self._state_entries = []
        for parameter in _parameters(self.optimizer):
            if parameter in self.optimizer.state:
                state = self.optimizer.state[parameter]
                plain = {key: _copied(value) for key, value in state.items() if not isinstance(value, torch.Tensor)}
                self._state_entries.append((parameter, tuple(state), plain))
        self._group_keys = [tuple(group) for group in self.optimizer.param_groups]
        self._group_values = [{key: _copied(value) for key, value in group.items()
                               if key != "params" and not isinstance(value, torch.Tensor)}
                              for group in self.optimizer.param_groups]
        self._scaler_absent = ()
        if self.scaler is not None and self.scaler.is_enabled():
            self._scaler_absent = tuple(name for name in _SCALER_TENSORS if getattr(self.scaler, name, None) is None)
        self._scheduler_state = _copied(self.scheduler.state_dict()) if self.scheduler is not None else None

    def _restore_state_entries(self) -> None:
        """The optimizer's state as it was: no entry for a parameter that had none (before its first step), no key
        the step added, the non-tensor values back (the tensors follow, slot by slot)."""
        had = {id(parameter): (keys, plain) for parameter, keys, plain in self._state_entries}
        for parameter in _parameters(self.optimizer):
            if id(parameter) not in had:
                self.optimizer.state.pop(parameter, None)
                continue
            keys, plain = had[id(parameter)]
            state = self.optimizer.state[parameter]
            for key in [key for key in state if key not in keys]:
                del state[key]
            state.update(_copied(plain))

    def _restore_group_values(self) -> None:
        for group, keys, values in zip(self.optimizer.param_groups, self._group_keys, self._group_values):
            for key in [key for key in group if key not in keys]:
                del group[key]
            group.update(_copied(values))

    def _put_back(self, slot: _Slot, saved: torch.Tensor) -> None:
        """Write the saved values into the live tensor (the same object, or the one the step bound in its place);
        where that one no longer fits, bind a copy of the saved one."""
        if slot.kind == "param":
            slot.owner.copy_(saved)
            return
        if slot.kind == "state":
            holder = self.optimizer.state[slot.owner]
            current = holder.get(slot.key)
        elif slot.kind == "group":
            holder = self.optimizer.param_groups[slot.owner]
            current = holder.get(slot.key)
        elif slot.kind == "buffer":
            current = self.model.get_buffer(slot.owner)
        else:
            current = getattr(self.scaler, slot.key)
        if _fits(current, saved):
            current.copy_(saved)
        elif slot.kind in ("state", "group"):
            holder[slot.key] = saved.clone()
        elif slot.kind == "buffer":
            path, _, name = slot.owner.rpartition(".")
            setattr(self.model.get_submodule(path), name, saved.clone())
        else:
            setattr(self.scaler, slot.key, saved.clone())


def room_for(undo: StepUndo) -> str | None:
    """None where the undo copy (and the optimizer state its first step will create) fits in the free memory of
    each CUDA device it lives on, with a margin; else one line saying what is needed and what is free. Always None
    on CPU."""
    if not torch.cuda.is_available():
        return None
    to_come = _state_to_come(undo.optimizer)
    for device, size in undo.bytes_by_device().items():
        if device.type != "cuda":
            continue
        needed = size - undo.held_bytes(device) + to_come.get(device, 0)  # the copy not yet allocated, new state
        free, total = torch.cuda.mem_get_info(device)
        margin = max(_MARGIN_MIN_BYTES, int(total * _MARGIN_FRACTION))
        if needed + margin > free:
            return (f"the step's undo copy needs {needed / 2**30:.2f} GiB more on {device} ({size / 2**30:.2f} GiB "
                    f"in all, the parameters and the optimizer state again) but {free / 2**30:.2f} GiB of "
                    f"{total / 2**30:.2f} GiB is free, and {margin / 2**30:.2f} GiB is kept spare")
    return None
