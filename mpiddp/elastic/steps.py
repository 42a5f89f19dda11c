"""In-job recovery for a torchrun-style loop, the loop untouched: wrap the model and the optimizer.

    from mpiddp import DistributedDataParallel        # was: from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model, device_ids=...)
    optimizer = mpiddp.Optimizer(optimizer, ddp)      # one line more
    ...                                               # the loop as it was: forward, backward, optimizer.step()

Run it under `mpirun --with-ft ulfm ... python -m mpiddp run train.py` (or `mpiddp launch ... run train.py`). The
shape of torchft's Manager with its DDP and optimizer wrappers: a step commits only when every rank completed it.

When a rank dies, the survivors notice it in that step's gradient all-reduce (waited for under MPI's failure
watch, so nobody waits out a timeout), and every rank's `optimizer.step()` ends the step with one fault-tolerant
agreement (MPI_Comm_agree: the same answer on every survivor). Where a rank did not complete the step, the step
is **skipped on every survivor alike**: its gradients are dropped and the optimizer does not step, so every
survivor holds the same model and optimizer and the loop's own counters stay equal. The survivors then recover
in the job (shrink to the survivors, a new process group on a new store, the DDP wrapper rebuilt over it in
place: names that hold it keep working), and the loop goes on from its next iteration at the reduced size.
Nothing is read from disk and no model moves: only a survivor that is behind (it cannot be, after a skip) would
take the furthest survivor's state.

DDP's broadcast of the module's buffers (BatchNorm's running statistics) before each forward is done by the
wrapper, watched the same way: a peer lost there marks the step failed, and the step is skipped alike.

Growing back onto a spare (StepLoop): the script declares the loop's own variables that hold its position
(`mpiddp.keep(globals(), "iter_num")`); a new rank runs the script from the top and joins at its first
`optimizer.step()` with rank 0's models, optimizers and those variables, where the survivors stand.

Without in-job recovery (no ULFM, torchrun, one line on rank 0 says why) both wrappers are plain: torch's DDP and
the optimizer itself. Failures outside these (a collective of the script's own, or after the loop: the job ends
with one line) are not recovered: the job ends as without the wrappers.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from mpiddp.elastic.api import Manager, ScriptRecovery, State
from mpiddp.elastic.grow import Regrown
from mpiddp.globalbatch import GlobalBatchError, balanced, share, split, uneven_split
from mpiddp.elastic.latecommit import LateCommit, late_refusal
from mpiddp.elastic.membership import MembersLost
from mpiddp.elastic.undo import StepUndo, room_for
from mpiddp.job.collective import current
from mpiddp.job.compression import WatchedAllReduce, layout_pending

log = logging.getLogger("mpiddp")

# torch's DDP skips its broadcast of the weights where it can (torch 2.5+): after a recovery every survivor holds
# the same weights already
_DDP_INIT_SYNC = "init_sync"
_DDP_FORWARD_SYNC = "forward_sync_buffers"  # torch 2.13+: `broadcast_buffers`, renamed (the old name warns)
TorchDict = dict[str, Any]  # torch's own type of a state dict, a param group, an optimizer's defaults


def _hook(watch, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none here
    return watch.run(bucket)


class DistributedDataParallel(nn.Module):
    """torch's DistributedDataParallel, the same arguments, that survives in-job recovery: after a recovery it
    builds torch's wrapper again over the survivors' process group, so every name that holds this one keeps
    working. Forward, `module`, `no_sync()`, `require_backward_grad_sync` and `state_dict()` behave as torch's
    (the state dict's keys start with `module.`). Without in-job recovery it is torch's wrapper inside this one.
    `manager`: the process's in-job recovery (mpiddp.DistributedDataParallel passes it)."""

    def __init__(self, module: nn.Module, *args: object, manager: Manager, **kwargs: object) -> None:
        super().__init__()
        self.manager = manager
        self._recovery = manager.enabled() if current() is not None else None  # torchrun: torch's DDP, nothing more
        recovery = self._recovery
        self.watch: WatchedAllReduce[MembersLost] | None = (
            WatchedAllReduce(recovery.current_members.wait, absorb=MembersLost) if recovery is not None else None)
        # DDP's buffer broadcast before each forward is a collective a failed peer would end the job in: under
        # in-job recovery this wrapper does it, watched (see WatchedAllReduce.broadcast_buffers)
        self._watched_buffers = False
        if self.watch is not None:
            kwargs, self._watched_buffers = _forward_sync_off(kwargs, _ddp_parameters())
        self._sync_next = True  # DDP's rule: after a forward with gradients to reduce (not under no_sync or no_grad)
        self._args, self._kwargs = args, kwargs
        # a rank a grow spawned (or woke) runs the script alone up to the loop's first optimizer step, where it takes
        # the survivors' state (StepLoop.join): until then torch's wrapper, whose construction is a collective the
        # survivors make at their take-in, waits
        joining = self._recovery is not None and self._recovery.awaiting_join
        self.ddp: nn.Module = Unjoined(module) if joining else self._wrap(module)
        manager.track_model(self)

    def __getstate__(self) -> dict[str, object]:
        """Pickled (torch.save of the whole wrapper, copy.deepcopy) without the process's in-job recovery, which
        holds this process's own references: the copy is handed the loading process's (mpiddp.script.wrappers)."""
        return {**self.__dict__, "manager": None}

    def _wrap(self, module: nn.Module, replicas_agree: bool = False) -> nn.parallel.DistributedDataParallel:
        kwargs = dict(self._kwargs)
        if replicas_agree and _DDP_INIT_SYNC in _ddp_parameters():
            kwargs[_DDP_INIT_SYNC] = False
        ddp = nn.parallel.DistributedDataParallel(module, *self._args, **kwargs)
        if self.watch is not None:
            ddp.register_comm_hook(self.watch, _hook)
            self.manager.track_wrapper(ddp)  # released before a recovery: checked gone, collected only if it is not
        return ddp

    def forward(self, *args: object, **kwargs: object) -> Any:
        if isinstance(self.ddp, Unjoined):  # a new rank's warm-up iteration: local, its gradients dropped at the join
            return self.ddp(*args, **kwargs)
        if self._watched_buffers and self._sync_next and self.watch is not None and tdist.get_world_size() > 1:
            ignored = set(getattr(self.ddp, "parameters_to_ignore", ()))
            buffers = [buffer for name, buffer in self.ddp.module.named_buffers() if name not in ignored]
            if buffers:
                self.watch.broadcast_buffers(buffers)
        output = self.ddp(*args, **kwargs)
        self._sync_next = torch.is_grad_enabled() and self.ddp.require_backward_grad_sync
        return output

    @property
    def module(self) -> nn.Module:
        return self.ddp.module

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.ddp.no_sync()

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.ddp.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:  # nanoGPT sets it for gradient accumulation
        self.ddp.require_backward_grad_sync = value

    def state_dict(self, *args: object, **kwargs: object) -> TorchDict:  # type: ignore[override]
        return self.ddp.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
        return self.ddp.load_state_dict(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            ddp = self._modules.get("ddp")
            if ddp is None:
                raise
            return getattr(ddp, name)

    # -- recovery's side --

    def release(self) -> nn.Module:
        """Before the survivors shrink: torch's wrapper goes (its reducer, left mid-step, hooks the parameters
        until it is destroyed); the module stays. Returns it."""
        module = self.ddp.module
        del self._modules["ddp"]
        return module

    def rewrap(self, module: nn.Module) -> None:
        """Collective over the survivors, once their process group is up: torch's wrapper again, over it."""
        self.ddp = self._wrap(module, replicas_agree=True)
        self._sync_next = True
        if self.watch is not None:
            self.watch.new_step()

    def join(self) -> None:
        """A new rank, collective over the merged job with the survivors' rewrap (StepLoop.join): torch's wrapper,
        now that this rank holds the survivors' weights."""
        unjoined = self.ddp
        assert isinstance(unjoined, Unjoined)
        self.rewrap(unjoined.release())
        self.ddp.require_backward_grad_sync = unjoined.require_backward_grad_sync


class Unjoined(nn.Module):
    """A new rank's stand-in for torch's DDP wrapper until it joins the survivors (DistributedDataParallel.join):
    the module itself, run locally (the warm-up iteration before the loop's first optimizer step: the kernels and
    any compilation warm, its gradients dropped at the join); `no_sync` and `require_backward_grad_sync` as DDP's."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True

    def forward(self, *args: object, **kwargs: object) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def release(self) -> nn.Module:
        module = self.module
        del self._modules["module"]
        return module


def _forward_sync_off(kwargs: dict[str, object], parameters: Mapping[str, inspect.Parameter]
                      ) -> tuple[dict[str, object], bool]:
    """DDP's arguments with its own buffer sync before each forward off, and whether they asked for that sync (the
    wrapper then does it, watched). torch 2.13 named it `forward_sync_buffers` and deprecated `broadcast_buffers`
    (a FutureWarning on every rank): where DDP takes the new name it is used, the old one dropped; before 2.13,
    `broadcast_buffers=False` (which there also leaves buffers out of DDP's sync at start)."""
    wanted = kwargs.get(_DDP_FORWARD_SYNC)
    if wanted is None:  # torch's rule: the new name, where given, wins; neither given means True
        wanted = kwargs.get("broadcast_buffers")
    if wanted is False:
        return dict(kwargs), False
    if _DDP_FORWARD_SYNC in parameters:
        rest = {name: value for name, value in kwargs.items() if name != "broadcast_buffers"}
        return {**rest, _DDP_FORWARD_SYNC: False}, True
    return {**kwargs, "broadcast_buffers": False}, True


def _ddp_parameters() -> Mapping[str, inspect.Parameter]:
    return inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters


class Optimizer(torch.optim.Optimizer):
    """`optimizer` (any torch optimizer) whose `step()` commits the step only when every rank completed it, and
    otherwise skips it on every survivor alike and recovers in the job (see the module). `model`: the
    mpiddp.DistributedDataParallel it trains (the wrappers whose parameters it holds are all watched). It is a
    torch Optimizer to schedulers and GradScaler: `param_groups`, `state`, `defaults` and every other attribute,
    read or written, are the optimizer's own. `steps` counts the steps taken, `skipped` the steps skipped.

    `commit="late"` (opt-in; default "strict"): the step does not wait for its all-reduces on the GPU; it is
    committed at the next step, and on a failure every survivor undoes it from a copy on the device (see
    mpiddp.elastic.latecommit: one step late costs nothing on the GPU, at the price of a copy of the parameters and
    the optimizer's state). Call `settle()` before a sync of the script's own with the GPU (`loss.item()`, a save).
    "auto" is late on GPUs, strict on CPU. Without in-job recovery every mode is the plain optimizer."""

    _OWN = frozenset({"optimizer", "model", "steps", "skipped", "_state", "_started", "_wrappers", "_generation",
                      "_late", "_strict_next", "_loop"})

    def __init__(self, optimizer: torch.optim.Optimizer, model: DistributedDataParallel,
                 commit: str = "strict") -> None:  # noqa: D107
        if not isinstance(model, DistributedDataParallel):
            raise TypeError("mpiddp.Optimizer(optimizer, model): model must be an mpiddp.DistributedDataParallel "
                            f"(from mpiddp import DistributedDataParallel), not {type(model).__name__}")
        # torch's Optimizer.__init__ is not called: the optimizer's own state is the one that counts
        self.optimizer, self.model = optimizer, model
        self.steps = self.skipped = 0
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        trained = [w for w in _live_wrappers(model.manager) if any(id(p) in held for p in w.module.parameters())]
        self._wrappers = [weakref.ref(w) for w in trained or [model]]
        self._state = State(model=model.module, optimizer=optimizer)
        self._started = time.time()
        self._generation = model.manager.generation
        self._late = self._arm_late_commit(commit)
        self._strict_next = True  # the first step, and the first after a recovery: DDP's first over a process group
        model.manager.track_optimizer(self)
        self._loop = StepLoop.attach(model.manager, self)  # growing back: the first optimizer is the loop's clock

    def _arm_late_commit(self, mode: str) -> LateCommit | None:
        """`commit="late"`: each step committed one step late (mpiddp.elastic.latecommit), where in-job recovery is
        on and the undo copy fits; one line on rank 0 says which mode is in force. None: each step waits for its
        all-reduces before the optimizer step (strict). Opt-in here, as a script that syncs with the GPU every step
        (`loss.item()`) gains nothing from it, and must call `settle()` before such a sync."""
        late_refusal(mode, "cpu", None)  # an unknown mode is an error with or without recovery
        if self.model._recovery is None:
            return None
        undo = StepUndo(self.model.module, self.optimizer)
        device = next((p.device for group in self.optimizer.param_groups for p in group["params"]), None)
        device_type = device.type if device is not None else "cpu"
        refusal = late_refusal(mode, device_type, room_for(undo) if mode != "strict" else None)
        if tdist.get_rank() == 0:  # a local log line, no collective
            if refusal is None:
                log.info("in-job recovery: each step commits one step late (an undo copy of %.1f MB on %s)",
                         undo.device_bytes() / 2**20, device_type)
            elif mode != "strict":
                log.warning("in-job recovery: not committing late (%s): each step waits for its all-reduces",
                            refusal)
        return None if refusal is not None else LateCommit(self.model._recovery.current_members, undo)

    def __setattr__(self, name: str, value: object) -> None:
        if name in self._OWN or hasattr(type(self), name):
            object.__setattr__(self, name, value)
        else:  # GradScaler's grad_scale and found_inf for fused optimizers, a user's own attributes
            setattr(self.optimizer, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._OWN or hasattr(type(self), name):
            object.__delattr__(self, name)
        else:
            delattr(self.optimizer, name)

    def __getattr__(self, name: str) -> Any:  # state, defaults, add_param_group, hooks ...
        if name in self._OWN:
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    @property  # type: ignore[override]
    def param_groups(self) -> list[TorchDict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[TorchDict]) -> None:
        self.optimizer.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, TorchDict]:
        return self.optimizer.state

    @property  # type: ignore[override]
    def defaults(self) -> TorchDict:
        return self.optimizer.defaults

    def step(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
        """The optimizer's step, when every rank completed this step's backward; None when it was skipped."""
        recovery = self.model._recovery
        wrappers = [w for ref in self._wrappers if (w := ref()) is not None and w.watch is not None]
        if recovery is None or not wrappers:
            return self._take(*args, **kwargs)
        loop = self._loop
        if loop is not None and loop.is_clock(self):
            if recovery.awaiting_join:  # a new rank's first step: it takes the survivors' state instead (collective)
                loop.join()
                return None
            loop.first_step()
        elif recovery.awaiting_join:  # another optimizer's step in a new rank's warm-up iteration: nothing to take
            self.optimizer.zero_grad(set_to_none=True)
            return None
        generation = self.model.manager.generation
        if self._generation != generation:  # its gradients were made before a recovery: on every survivor
            self._generation = generation
            self._strict_next = True
            self._skip()
            return None
        if self._late is not None and not self._strict_next:
            return self._late_step(recovery, wrappers, args, kwargs)
        lost = None
        for wrapper in wrappers:
            lost = wrapper.watch.settle() or lost
        if self._strict_next:  # DDP's first step over this process group: its bucket re-layout, watched
            for wrapper in wrappers:
                lost = lost or wrapper.watch.rebuild_buckets(wrapper.ddp)
        completed = recovery.members.all_completed(lost is None)
        for wrapper in wrappers:
            wrapper.watch.new_step()
        if completed:  # strict until DDP has laid its buckets out (after its second step with a static graph)
            self._strict_next = any(layout_pending(wrapper.ddp) for wrapper in wrappers)
            return self._take(*args, **kwargs)
        self._skip_and_recover(recovery, lost)
        return None

    def _late_step(self, recovery: ScriptRecovery, wrappers: list[DistributedDataParallel],
                   args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        """The step under the late commit: the held step agreed on (its works long done), this one held (its works
        unwaited) and taken; where the agreement says a rank failed, both are dropped on every survivor alike."""
        assert self._late is not None
        lost = next((wrapper.watch.lost for wrapper in wrappers if wrapper.watch.lost is not None), None)
        works = [work for wrapper in wrappers for work in wrapper.watch.take_pending()]
        agreed = self._late.agree(completed_since=lost is None)
        for wrapper in wrappers:
            wrapper.watch.new_step()
        if not agreed:
            self._skip_and_recover(recovery, lost or self._late.members_lost())
            return None
        self._late.hold(works)
        return self._take(*args, **kwargs)

    def settle(self) -> None:
        """Under `commit="late"`, before a sync of the script's own with the GPU (`loss.item()`, a save, an
        evaluation): the held step agreed on now, so the sync cannot wait on an all-reduce a dead peer never
        finishes; where a rank failed, the survivors recover here. Collective; a no-op in strict mode."""
        recovery = self.model._recovery
        if self._late is None or recovery is None or not self._late.holding:
            return
        if not self._late.agree():
            self._skip_and_recover(recovery, self._late.members_lost(), skipping=False)

    def roll_back_held(self) -> bool:
        """After a failure, on every survivor alike: the step the late commit holds undone (counted skipped).
        True where one was held."""
        if self._late is None or not self._late.roll_back():
            return False
        self.steps -= 1
        self.skipped += 1
        return True

    def _take(self, *args: object, **kwargs: object) -> object:
        result = self.optimizer.step(*args, **kwargs)
        self.steps += 1
        try:
            self._state.commit()
        except Regrown:  # new ranks joined at this step (StepLoop.rewrap_grown): the loop goes on, the job grown
            pass
        self._started = time.time()
        return result

    def grows_at_steps(self, recovery: ScriptRecovery) -> None:
        """This optimizer is the loop's clock (StepLoop): a grow is taken in at its steps, once committed."""
        self._state.at_each_commit(recovery.at_commit)

    def handover(self) -> TorchDict:
        """Rank 0's at a grow (StepLoop.handover): the optimizer's state and this wrapper's counts."""
        return {"state": self.optimizer.state_dict(), "steps": self.steps, "skipped": self.skipped,
                "commits": self._state.commits}

    def take_over(self, handed: TorchDict) -> None:
        """A new rank, as it joins: rank 0's `handover`; this rank's own warm-up gradients dropped."""
        self.optimizer.load_state_dict(handed["state"])
        self.steps, self.skipped = handed["steps"], handed["skipped"]
        self._state.load({"objects": {}, "values": {}, "commits": handed["commits"]})
        self.after_grow()

    @property
    def commits(self) -> int:
        return self._state.commits

    def after_grow(self) -> None:
        """Every rank of a grown job: no gradient left from before it, and the next step, DDP's first over the new
        process group, waits for its all-reduces (strict)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._strict_next = True

    def _skip(self) -> None:
        self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)

    def _skip_and_recover(self, recovery: ScriptRecovery, lost: MembersLost | None, skipping: bool = True) -> None:
        """Collective over the survivors: drop this step (`skipping`) and undo every held one, shrink, rebuild
        every wrapper over the survivors."""
        manager = self.model.manager
        if lost is None:  # this rank completed the step; another did not (or failed since): the agreement said so
            lost = MembersLost(recovery.members.failed() or (), recovery.members.lost_at or time.time())
        self.skipped += skipping
        # queued on the device behind the steps they undo: after NCCL's abort they run last
        undone = sum(optimizer.roll_back_held() for optimizer in _live_optimizers(manager))
        wrappers = _live_wrappers(manager)
        modules = [wrapper.release() for wrapper in wrappers]
        recovery.recover(lost, self._state, self._started)  # syncs the state, drops the step's gradients
        for wrapper, module in zip(wrappers, modules):
            wrapper.rewrap(module)
        manager.generation += 1
        self._generation = manager.generation
        self._strict_next = True
        self._started = time.time()
        if tdist.get_rank() == 0:  # a local log line, no collective
            log.warning("in-job recovery: the step a failed rank did not complete was skipped on every survivor%s "
                        "(steps taken %d, skipped %d)", " and the step before it undone" if undone else "",
                        self.steps, self.skipped)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> TorchDict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: TorchDict) -> None:
        self.settle()  # a held step's undo record would put its pre-step values back over the loaded ones
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: TorchDict) -> None:
        self.settle()  # a held step's undo record knows the groups there were at its step: agreed on first
        self.optimizer.add_param_group(param_group)

    def __getstate__(self) -> dict[str, object]:  # the wrappers it watches, its late commit: this process's
        return {name: value for name, value in self.__dict__.items() if name not in ("_wrappers", "_late", "_loop")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__dict__["_wrappers"] = [weakref.ref(self.model)]  # the model loaded with it
        self.__dict__["_late"] = None  # a loaded copy waits for each step's all-reduces
        self.__dict__["_loop"] = None  # and never grows the job back
        self.__dict__.setdefault("_strict_next", True)

    def __repr__(self) -> str:
        return f"mpiddp.Optimizer({self.optimizer!r}, steps={self.steps}, skipped={self.skipped})"


class StepLoop:
    """Growing back for a torchrun-style loop under mpiddp.Optimizer (outside run_recoverable), one per process, made
    by the loop's first optimizer, its clock. The survivors take new ranks in at a step of the clock, once taken
    (its commit, where run_recoverable's State commits). A new rank runs the script from the top: its wrappers wait
    (Unjoined), it runs the loop's first iteration alone (warm), and at its first step of the clock it takes every
    model's and optimizer's state, their counts and the loop's own variables the script declared (mpiddp.keep) from
    rank 0: it then stands where the survivors stand, inside that step, and the loop goes on alike everywhere."""

    def __init__(self, manager: Manager, recovery: ScriptRecovery, clock: Optimizer) -> None:
        self.manager, self.recovery = manager, recovery
        self.clock = weakref.ref(clock)
        self.started = False  # the clock took its first step: whether the spares are of use was decided

    @classmethod
    def attach(cls, manager: Manager, optimizer: Optimizer) -> StepLoop | None:
        """The process's step loop (made with `optimizer` as its clock where there is none, or its clock is gone);
        None without in-job recovery, or inside run_recoverable (whose State grows back)."""
        recovery = manager.active()
        if recovery is None or manager.running:
            return None
        if not isinstance(recovery.loop, StepLoop):
            recovery.loop = cls(manager, recovery, optimizer)
            optimizer.grows_at_steps(recovery)
        return recovery.loop

    @property
    def grows(self) -> bool:
        return self.manager.kept is not None

    def is_clock(self, optimizer: Optimizer) -> bool:
        """Whether `optimizer` is the loop's clock; it becomes the clock where the first is gone (a script that
        replaced its first optimizer by one over more parameters)."""
        if self.clock() is None:
            self.clock = weakref.ref(optimizer)
            optimizer.grows_at_steps(self.recovery)
        return self.clock() is optimizer

    def first_step(self) -> None:
        """Every rank, at the clock's steps (not collective): at the first, the spares go where the loop cannot
        grow back (Manager.release_spares_of_step_loop)."""
        if not self.started:
            self.started = True
            self.manager.release_spares_of_step_loop()

    # -- the survivors' side (ScriptRecovery's hooks: mpiddp.elastic.api.StepLoopHooks) --

    def handover(self) -> dict[str, object]:
        kept = self.manager.kept
        return {"models": [wrapper.module.state_dict() for wrapper in _live_wrappers(self.manager)],
                "optimizers": [optimizer.handover() for optimizer in _live_optimizers(self.manager)],
                "kept": kept.values() if kept is not None else {}}

    def settle_for_grow(self) -> bool:
        generation = self.manager.generation
        for optimizer in _live_optimizers(self.manager):
            optimizer.settle()
        return self.manager.generation == generation

    def rewrap_grown(self) -> None:
        wrappers = _live_wrappers(self.manager)
        modules = [wrapper.release() for wrapper in wrappers]
        self.manager.drop_old_wrappers()
        for wrapper, module in zip(wrappers, modules):
            wrapper.rewrap(module)
        for optimizer in _live_optimizers(self.manager):
            optimizer.after_grow()

    # -- the new rank's side --

    def join(self) -> None:
        """A new rank's first step of the clock, collective over the merged job with the survivors' take-in."""
        self.recovery.join_step_loop(self._take_over)
        self.started = True

    def _take_over(self, handed: dict[str, Any]) -> int:
        """Rank 0's `handover` into this rank's models, optimizers and kept variables, then torch's wrappers over
        the merged job (as the survivors' rewrap_grown). Returns the clock's commits (the job's step)."""
        wrappers, optimizers = _live_wrappers(self.manager), _live_optimizers(self.manager)
        if len(wrappers) != len(handed["models"]) or len(optimizers) != len(handed["optimizers"]):
            raise RuntimeError(f"growing back: this rank's script built {len(wrappers)} mpiddp.DistributedDataParallel "
                               f"and {len(optimizers)} mpiddp.Optimizer before its first step, the survivors "
                               f"{len(handed['models'])} and {len(handed['optimizers'])}: build every one before "
                               "the loop")
        kept = self.manager.kept
        if handed["kept"] and kept is None:
            raise RuntimeError("growing back: the survivors keep the loop's variables (mpiddp.keep), which this "
                               "rank's script did not declare before its first optimizer step")
        for wrapper, state in zip(wrappers, handed["models"]):
            wrapper.module.load_state_dict(state)
        for optimizer, entry in zip(optimizers, handed["optimizers"]):
            optimizer.take_over(entry)
        if kept is not None:
            kept.load(handed["kept"])
        for wrapper in wrappers:
            wrapper.join()
        clock = self.clock()
        return clock.commits if clock is not None else 0


def _live_optimizers(manager: Manager) -> list[Optimizer]:
    return [optimizer for optimizer in manager.live_optimizers() if isinstance(optimizer, Optimizer)]


def _live_wrappers(manager: Manager) -> list[DistributedDataParallel]:
    """Every one of mpiddp's DDP wrappers of this process still in use (the Manager keeps them as modules)."""
    return [model for model in manager.live_models() if isinstance(model, DistributedDataParallel)]


def _world_now() -> tuple[int, int]:
    """(this rank, the number of ranks) there are now: after a recovery, the survivors'."""
    if tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    dist = current()
    return (dist.rank, dist.world_size) if dist is not None else (0, 1)


def split_global_batch(global_batch: int, max_per_rank: int) -> tuple[int, int]:
    """(per-rank batch, accumulation steps) that keep `global_batch` samples per optimizer step over the ranks
    there are now (after a recovery, fewer): per-rank x ranks x accumulation == global_batch, the per-rank batch
    at most `max_per_rank` (it stays that when it divides: only the accumulation grows). Call it again after a
    recovery (`optimizer.skipped` grew, or in an on_membership_change callback). ValueError, one line, where no
    exact split exists: share_global_batch then shares it unevenly."""
    if global_batch < 1 or max_per_rank < 1:
        raise ValueError(f"split_global_batch({global_batch}, {max_per_rank}): both must be at least 1")
    try:
        return split(global_batch, _world_now()[1], max_per_rank)
    except GlobalBatchError as exc:
        raise GlobalBatchError(f"{exc}: mpiddp.share_global_batch shares it unevenly, each rank's loss weighted by "
                               "its share") from None


@dataclass(frozen=True)
class BatchShare:
    """This rank's part of every optimizer step of `global_batch` samples over `world_size` ranks, on any number of
    ranks (share_global_batch): the step's positions it takes, in `micro_batches` (its samples in each; every rank
    runs as many, as DDP needs), and the weight of each micro-batch's mean loss. Where the global batch does not
    split evenly some ranks take one sample more; weighted by loss_scale, DDP's average of the ranks' gradients is
    the gradient of the mean loss over the step's `global_batch` samples: the update the full-size job makes on
    them (up to the order of floating-point sums)."""

    global_batch: int
    world_size: int
    rank: int
    micro_batches: tuple[int, ...]

    @classmethod
    def over(cls, global_batch: int, world_size: int, rank: int, max_per_rank: int) -> BatchShare:
        """Rank `rank`'s share of `world_size` ranks, at most `max_per_rank` samples a micro-batch. ValueError
        (GlobalBatchError), one line, where a rank would get an empty micro-batch."""
        if global_batch < 1 or max_per_rank < 1 or not 0 <= rank < world_size:
            raise ValueError(f"BatchShare.over({global_batch}, {world_size}, {rank}, {max_per_rank}): the batches "
                             "must be at least 1, the rank one of the ranks")
        # as few micro-batches as `max_per_rank` allows, of balanced sizes (an even split too: 17 samples at most 16
        # are 9 + 8, not the 17 micro-batches of 1 that equal sizes would need)
        _, accumulation = uneven_split(global_batch, world_size, max_per_rank)
        return cls(global_batch, world_size, rank, tuple(balanced(share(global_batch, world_size, rank),
                                                                  accumulation)))

    @property
    def positions(self) -> range:
        """The positions of a step (0 .. global_batch - 1) this rank takes: rank, rank + W, rank + 2W, ..."""
        return range(self.rank, self.global_batch, self.world_size)

    def steps_in(self, num_samples: int) -> int:
        """The optimizer steps an epoch of `num_samples` holds: whole steps only (the rest is left out, as
        DistributedSampler(drop_last=True) leaves it), the same on any number of ranks."""
        return num_samples // self.global_batch

    def indices(self, order: Sequence[int], step: int) -> list[list[int]]:
        """This rank's micro-batches of step `step` (from 0) of an epoch whose samples come in `order` (the same
        on every rank, e.g. a permutation drawn from the epoch's seed): the step takes
        order[step x G : (step + 1) x G], whatever the number of ranks, so the position in the epoch carries over
        a change of size exactly."""
        start = step * self.global_batch
        if step < 0 or start + self.global_batch > len(order):
            raise ValueError(f"step {step} is not one of the {self.steps_in(len(order))} whole steps of "
                             f"{len(order)} samples at a global batch of {self.global_batch}")
        mine = [order[start + position] for position in self.positions]
        bounds = [sum(self.micro_batches[:index]) for index in range(len(self.micro_batches) + 1)]
        return [mine[bounds[index]:bounds[index + 1]] for index in range(len(self.micro_batches))]

    def loss_scale(self, samples: int) -> float:
        """The factor for the mean loss of a micro-batch of `samples`: samples x ranks / global batch (1.0 for
        each of an even split's micro-batches with no accumulation), so that DDP's average is the step's mean."""
        return samples * self.world_size / self.global_batch


def share_global_batch(global_batch: int, max_per_rank: int) -> BatchShare:
    """This rank's BatchShare of `global_batch` samples per optimizer step over the ranks there are now (after a
    recovery, the survivors; after a grow, the grown job): any number of ranks keeps the global batch exactly.
    Call it again after a change of size (in an on_membership_change callback), and multiply each micro-batch's
    mean loss by `share.loss_scale(len(batch))` before backward."""
    rank, world_size = _world_now()
    return BatchShare.over(global_batch, world_size, rank, max_per_rank)


__all__ = ["BatchShare", "DistributedDataParallel", "Optimizer", "share_global_batch", "split_global_batch"]
