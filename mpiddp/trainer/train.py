"""The training loop from parts: a step, an epoch, evaluation, and the cadence of logging and saving.
It never decides *who* logs or saves: the hooks trainer/run.py (trainer/join.py for a rank that joins) hands it do."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ContextManager, NoReturn

import torch
from torch import nn

from mpiddp.errors import UserError
from mpiddp.job.collective import Dist
from mpiddp.job.log import NullProgress, make_progress, progress_wanted
from mpiddp.job.stopping import Stopped, StopRequest
from mpiddp.trainer.callbacks import Callback, Callbacks
from mpiddp.trainer.config import Config, TrainingSettings
from mpiddp.trainer.data import Loaders, stop_workers
from mpiddp.trainer.drills import drills_for
from mpiddp.trainer.metrics import RunLogger
from mpiddp.trainer.saveclock import SaveClock
from mpiddp.trainer.state import TrainState, optimizer_steps_per_epoch
from mpiddp.trainer.steptime import StepClock, StepDurations, StepTime

if TYPE_CHECKING:
    from mpiddp.trainer.commit import StepCommit

log = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class RankTiming:
    """This rank's own clock readings, of a fixed size however long the run; gathered at the end, never
    synchronised per step."""

    warmup_steps: int
    durations: StepDurations = field(default_factory=StepDurations)
    images_after_warmup: int = 0
    seconds_after_warmup: float = 0.0
    first_step_done_at: float | None = None  # time.time() when the first step finished

    def record(self, step: StepTime) -> None:
        self.durations.add(step)
        if self.durations.count > self.warmup_steps:
            self.images_after_warmup += step.images
            self.seconds_after_warmup += step.step

    @property
    def steps(self) -> int:
        return self.durations.count


@dataclass
class Meter:
    """Summed training loss (on the device: read back only when reduced), images and seconds on this rank."""

    loss: torch.Tensor
    images: int = 0
    seconds: float = 0.0

    @classmethod
    def on(cls, device: torch.device) -> Meter:
        return cls(torch.zeros((), device=device))

    def add(self, loss_sum: torch.Tensor, images: int) -> None:
        self.loss += loss_sum
        self.images += images

    def take_back(self, loss_sum: torch.Tensor, images: int) -> None:
        """A step counted, then undone (the late commit's rollback): it is trained again and counted then."""
        self.loss -= loss_sum
        self.images -= images

    def reduced(self, dist: Dist) -> tuple[float, int, float]:
        """Collective: (mean loss per image, images, seconds of the slowest rank) over the whole job."""
        loss_total, images = dist.reduce([self.loss.item(), self.images], "sum")
        (slowest,) = dist.reduce([self.seconds], "max")
        return loss_total / max(1.0, images), int(images), slowest


@dataclass
class Hooks:
    """What the loop calls out to. On ranks other than 0 the logger does nothing; `save` is collective.
    `save_clock` (--save-interval) asks for snapshots by time; global rank 0's decides."""

    log: RunLogger
    save: Callable[[TrainState], None]
    stop: StopRequest
    heartbeat: Callable[[str, int], None] = lambda phase, step: None
    save_clock: SaveClock = field(default_factory=SaveClock)
    # where in a step this rank is (data, compute, communication), for the hang watchdog: not progress
    phase: Callable[[str], None] = lambda phase: None
    # called at fixed points of each step (the --inject-fault drills are one, added by `train`)
    callbacks: Callback = field(default_factory=Callbacks)
    # in-job recovery (mpiddp.trainer.elastic_policy): runs body(config) and, after the survivors recovered from a failed
    # rank, again with their config; `where` is train, eval or save. Without it: body(config), once.
    in_job: Callable[[Callable[[Config], Any], Config, str], Any] = lambda body, cfg, where: body(cfg)
    # whether in_job runs a body again after a failure the survivors recovered from, not after a grow (the same on
    # every rank): only a failure can leave a step's metric line unwritten (log_caught_up_step)
    again_after_failure: Callable[[], bool] = lambda: True

    def save_now(self, state: TrainState) -> None:
        """Collective: save a snapshot, whatever the reason; the time-based interval counts from here."""
        self.callbacks.on_save_start(state.step)
        self.save(state)
        self.save_clock.restart()

    def save_or_again(self, state: TrainState) -> None:
        """Collective: save_now, through in-job recovery: a rank lost during the save gives it up (rank 0 writes
        atomically, so `latest` still names the last complete snapshot) and the survivors save again. For a
        save after which no step of the running epoch follows (an epoch's end, a stop); a mid-epoch save's
        failure is the epoch's own, whose run again saves at its next step (the save clock is still due)."""
        self.in_job(lambda current: self.save_now(state), None, "save")


@dataclass
class TrainOutcome:
    epochs: list[dict[str, Any]]
    timing: RankTiming


def autocast_for(amp: str, device: torch.device) -> ContextManager[Any]:
    if amp == "off":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


def micro_batch_groups(batches: Iterable[Batch], grad_accum: int) -> Iterator[list[Batch]]:
    """Consecutive groups of `grad_accum` micro-batches, one per optimizer step; the last may be shorter."""
    group: list[Batch] = []
    for batch in batches:
        group.append(batch)
        if len(group) == grad_accum:
            yield group
            group = []
    if group:
        yield group


def train_step(
    state: TrainState, micro_batches: list[Batch], device: torch.device, amp: str = "off",
    memory_format: torch.memory_format = torch.contiguous_format, sample_weight: float | None = None,
    loss_fn: nn.Module | None = None,
) -> tuple[torch.Tensor, int]:
    """One optimizer step: forward and backward on every micro-batch, gradients all-reduced on the last one
    only (no_sync before), then scaler, optimizer and schedule. Returns (summed loss on the device, images).

    Each micro-batch's mean loss is divided by their number, so equal micro-batches on every rank give the
    gradient of the mean loss over the global batch. Under an uneven split (`sample_weight`: ranks / the step's
    samples, Loaders.sample_weight) it is scaled by its samples x that instead: DDP's average over the ranks is
    then the same gradient, whatever each rank's share.
    """
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    loss_sum = torch.zeros((), device=device)
    images = 0
    for index, (inputs, targets) in enumerate(micro_batches):
        inputs = inputs.to(device, non_blocking=True, memory_format=memory_format)
        targets = targets.to(device, non_blocking=True)
        with nullcontext() if index == len(micro_batches) - 1 else state.ddp.no_sync():
            with autocast_for(amp, device):
                loss = loss_fn(state.model(inputs), targets)
            scaled = loss / len(micro_batches) if sample_weight is None else loss * (len(targets) * sample_weight)
            state.scaler.scale(scaled).backward()
        loss_sum += loss.detach().float() * len(targets)
        images += len(targets)
    if state.commit is not None:  # in-job recovery: a dead peer noticed here (strict), or at the next step (late)
        state.commit.before_step(state)
    elif state.gradient_hook is not None:
        state.gradient_hook.settle()
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    state.step += 1
    return loss_sum, images


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable[Batch], device: torch.device, amp: str = "off",
             memory_format: torch.memory_format = torch.contiguous_format,
             heartbeat: Callable[[str, int], None] = lambda phase, step: None,
             step: int = 0, should_stop: Callable[[], bool] = lambda: False) -> tuple[float, float, float]:
    """(correct, summed loss, count) over this rank's eval shard, cut short when `should_stop()` says so.

    Runs the unwrapped module: DDP's forward may broadcast buffers, a collective that would deadlock
    when ranks hold different numbers of eval batches.
    """
    model.eval()
    correct = torch.zeros((), device=device)
    loss_sum = torch.zeros((), device=device)
    count = 0
    for inputs, targets in loader:
        heartbeat("eval", step)
        if should_stop():  # a stop signal: the scheduler's grace period is for saving, not evaluating
            break
        inputs = inputs.to(device, non_blocking=True, memory_format=memory_format)
        targets = targets.to(device, non_blocking=True)
        with autocast_for(amp, device):
            logits = model(inputs)
        loss_sum += nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
        correct += (logits.argmax(dim=1) == targets).sum()
        count += len(targets)
    model.train()
    return float(correct.item()), float(loss_sum.item()), float(count)


def reached_collective(clock: StepClock, hooks: Hooks) -> Callable[[], None]:
    """What the gradient hook calls as a bucket's all-reduce starts: the clock's end of compute, and the phase
    the hang watchdog reads (a rank that never gets here holds up the others)."""
    def ready() -> None:
        clock.gradients_ready()
        hooks.phase("communication")

    return ready


def step_record(window: Meter, dist: Dist, state: TrainState, epoch: int) -> dict[str, Any]:
    """Collective: the metric line for the steps since the last one."""
    loss, images, slowest = window.reduced(dist)
    return {
        "kind": "step",
        "epoch": epoch,
        "step": state.step,
        "loss": loss,
        "lr": state.optimizer.param_groups[0]["lr"],
        "images_per_second": images / slowest if slowest > 0 else 0.0,
        "time": time.time(),
    }


@dataclass
class EpochMeters:
    """An epoch's readings on this rank: its totals, the window since the last metric line, its step times."""

    clock: StepClock
    timing: RankTiming
    totals: Meter
    window: Meter
    logged_step: int  # the step of this rank's last metric line (its window's reduction returned): none pending
    durations: StepDurations = field(default_factory=StepDurations)

    @classmethod
    def on(cls, device: torch.device, timing: RankTiming, step: int) -> EpochMeters:
        return cls(StepClock(device), timing, Meter.on(device), Meter.on(device), step)

    def add(self, loss_sum: torch.Tensor, images: int, commit: StepCommit | None = None) -> None:
        """A step's loss and images; `commit`: the late commit, told how to take them out if it undoes the step."""
        self.totals.add(loss_sum, images)
        self.window.add(loss_sum, images)
        if commit is not None:
            commit.counted(partial(self.take_back, loss_sum, images))

    def take_back(self, loss_sum: torch.Tensor, images: int) -> None:
        self.totals.take_back(loss_sum, images)
        self.window.take_back(loss_sum, images)

    def account(self) -> None:
        """Read the clock (on a GPU this waits for the device: only where the loop syncs anyway)."""
        for step in self.clock.flush():
            self.totals.seconds += step.step
            self.window.seconds += step.step
            self.durations.add(step)
            self.timing.record(step)


def epoch_meters(kept: list[EpochMeters], device: torch.device, timing: RankTiming, step: int) -> EpochMeters:
    """The epoch's meters: new, or the ones `kept` from this epoch's run before an in-job recovery re-ran it (its
    steps before the failure stay counted in the epoch's loss, images and time, and in the job's steps); the
    step clock starts again, so recovery's downtime is in the recovery's record, not in a step's time."""
    if kept:
        kept[0].clock.restart()
        return kept[0]
    kept.append(EpochMeters.on(device, timing, step))
    return kept[0]


def train_epoch(cfg: Config, state: TrainState, loaders: Loaders, dist: Dist, hooks: Hooks, epoch: int,
                timing: RankTiming, kept: list[EpochMeters] | None = None) -> tuple[Meter, StepDurations]:
    """Collective: one epoch's steps (from where a stopped run left off). Returns this rank's totals and step
    times. On an agreed stop signal: saves, then raises Stopped on every rank at the same step. `kept`: the
    epoch's meters across in-job recoveries (see epoch_meters)."""
    device = dist.device
    memory_format = torch.channels_last if cfg.training.channels_last else torch.contiguous_format
    skipped = state.batches_done
    loaders.set_epoch(epoch, skip_batches=skipped)
    epoch_batches = skipped + len(loaders.train)
    progress = make_progress(progress_wanted(cfg.outputs.progress) and dist.is_main,
                             optimizer_steps_per_epoch(len(loaders.train), cfg.training.grad_accum), f"epoch {epoch}/{cfg.training.epochs}")
    state.model.train()
    again = bool(kept)  # run again after an in-job recovery or a grow
    meters = epoch_meters([] if kept is None else kept, device, timing, state.step)
    # Not after a grow (taken in at a step boundary, after the last step's line; a new rank's meters start at its
    # step): its collective held every survivor until the new rank came, 5-25 ms of a take-in's stand-still
    if again and hooks.again_after_failure():
        log_caught_up_step(meters, dist, state, hooks, epoch, progress, cfg.outputs.log_every)
    clock = meters.clock
    if state.gradient_hook is not None:
        state.gradient_hook.on_ready = reached_collective(clock, hooks)
    batches_seen = skipped
    groups = micro_batch_groups(loaders.train, cfg.training.grad_accum)
    while True:
        clock.waiting_for_data()
        hooks.phase("data")
        hooks.callbacks.on_data_wait(state.step)
        group = next(groups, None)
        if group is None:
            break
        clock.computing()
        hooks.phase("compute")
        hooks.callbacks.on_batch_loaded(state.step)
        loss_sum, images = train_step(state, group, device, cfg.training.amp, memory_format,
                                      loaders.sample_weight(batches_seen))
        clock.step_done(images)
        if timing.first_step_done_at is None:
            timing.first_step_done_at = time.time()
            hooks.log.log({"kind": "first_step", "step": state.step, "time": timing.first_step_done_at})  # downtime
        hooks.callbacks.on_step_end(state.step)
        batches_seen += len(group)
        state.batches_done = batches_seen  # where in-job recovery continues the epoch
        meters.add(loss_sum, images, state.commit)
        progress.update(1)
        hooks.heartbeat("train", state.step)
        # One reduction per step carries both the stop signal and rank 0's clock's call for a snapshot.
        signum, save_due = hooks.stop.agreed_with_save(dist, hooks.save_clock.due())
        if signum:
            progress.close()
            stop_in_epoch(signum, state, dist, hooks, epoch, meters, batches_seen, epoch_batches,
                          cfg.outputs.log_every)
        if state.step % cfg.outputs.log_every == 0:  # before a snapshot: a resume from it starts after this step
            log_window(meters, dist, state, hooks, epoch, progress)
        if save_due:
            save_by_time(state, hooks, batches_seen, epoch_batches)
    settle(state)
    meters.account()
    progress.close()
    return meters.totals, meters.durations


def settle(state: TrainState) -> None:
    """Collective, where the loop syncs with the GPU (a metric line, a save, the epoch's end): a step held by the
    late commit agreed on first (mpiddp.trainer.commit), so no sync waits on an all-reduce a dead peer left."""
    if state.commit is not None:
        state.commit.settle()


def save_by_time(state: TrainState, hooks: Hooks, batches_seen: int, epoch_batches: int) -> None:
    """Collective, where every rank agreed rank 0's clock called for a snapshot (--save-interval): mid-epoch it
    saves now, resumed as a stop's is; on the epoch's last step the epoch's own snapshot, after its evaluation, is
    the one, not a copy before it."""
    settle(state)
    if batches_seen < epoch_batches:
        state.batches_done = batches_seen
        hooks.save_now(state)
    else:
        hooks.save_clock.pending = True


def log_window(meters: EpochMeters, dist: Dist, state: TrainState, hooks: Hooks, epoch: int, progress: Any) -> None:
    """Collective: the metric line for the steps since the last one (the only per-window sync); a new window."""
    settle(state)
    meters.account()
    record = step_record(meters.window, dist, state, epoch)
    hooks.log.log(record)
    progress.update(0, postfix=f"loss {record['loss']:.4f}")
    meters.window, meters.logged_step = Meter.on(dist.device), state.step


def log_caught_up_step(meters: EpochMeters, dist: Dist, state: TrainState, hooks: Hooks, epoch: int, progress: Any,
                       log_every: int) -> None:
    """Collective, as an epoch runs again after an in-job recovery (not after a grow): the
    metric line of a step whose update was done when the failure struck in the step's exchanges after it (the
    stop agreement, the line's own reduction), so the survivors caught up on it and never train it again. Rank 0
    writes the lines, so its word decides: a line it wrote before the failure is not written twice. A new rank 0
    knows only its own part: where the old one died just before or after writing the line, that one line can stay
    missing or come twice."""
    due = state.step % log_every == 0 and meters.logged_step < state.step
    if dist.from_main(lambda: due):
        log_window(meters, dist, state, hooks, epoch, progress)


def stop_in_epoch(signum: int, state: TrainState, dist: Dist, hooks: Hooks, epoch: int, meters: EpochMeters,
                  batches_seen: int, epoch_batches: int, log_every: int) -> NoReturn:
    """Collective: every rank agreed to stop after this step: its metric line when one is due (before the save:
    the resume starts after this step, so a line written later would be lost with a stop), then save where the
    epoch stands, raise Stopped."""
    settle(state)
    if state.step % log_every == 0 and meters.logged_step < state.step:
        log_window(meters, dist, state, hooks, epoch, NullProgress())  # the caller closed the bar
    state.batches_done = batches_seen
    if batches_seen >= epoch_batches:  # the epoch's training is complete: saved as the epoch, as a stop
        meters.account()  # during its evaluation is (never a 0-step epoch later), its evaluation left to the resume
        state.pending_epoch = training_record(state, dist, epoch, meters.totals, meters.durations)
        state.epoch, state.batches_done = epoch, 0
        if dist.is_main:  # a local log line, no collective
            log.warning("stopping after the last step of epoch %d: its training is saved, its evaluation is "
                        "left to --resume", epoch)
    hooks.save_or_again(state)
    raise Stopped(signal.Signals(signum).name, state.step)


def evaluate_or_stop(training: TrainingSettings, state: TrainState, loaders: Loaders, dist: Dist, hooks: Hooks,
                     epoch: int) -> tuple[float, float, float]:
    """Collective: evaluate this rank's shard, stopping early on a signal. When any rank got one, every rank
    saves the epoch (its training is complete) and raises Stopped; otherwise this rank's eval sums."""
    memory_format = torch.channels_last if training.channels_last else torch.contiguous_format
    sums = (0.0, 0.0, 0.0)
    started: list[None] = []

    def heartbeat(phase: str, step: int) -> None:
        if not started:  # once, at the first batch
            started.append(hooks.callbacks.on_eval_start(step))
        hooks.heartbeat(phase, step)

    if loaders.eval is not None:
        sums = evaluate(state.unwrapped, loaders.eval, dist.device, training.amp, memory_format, heartbeat,
                        state.step, should_stop=lambda: bool(hooks.stop.signum))
    signum = hooks.stop.agreed(dist)
    if signum:  # the snapshot keeps state.pending_epoch: a resume evaluates the epoch and writes its record
        if dist.is_main:  # a local log line, no collective
            log.warning("stopping during the evaluation of epoch %d: its training is saved, its evaluation is left to "
                        "--resume", epoch)
        hooks.save_or_again(state)
        raise Stopped(signal.Signals(signum).name, state.step)
    return sums


def training_record(state: TrainState, dist: Dist, epoch: int, totals: Meter,
                    epoch_durations: StepDurations) -> dict[str, Any]:
    """Collective: the training half of the epoch's record, taken when its training is complete. A stop before
    its evaluation keeps it in the snapshot, so the resume that evaluates the epoch writes the whole record.
    The per-rank step times only rank 0 logs: gathered there, None on the other ranks."""
    train_loss, train_images, slowest = totals.reduced(dist)
    rank_means = dist.gather((epoch_durations.step.mean, epoch_durations.data_wait.mean, epoch_durations.compute.mean))
    return {
        "kind": "epoch",
        "epoch": epoch,
        "step": state.step,
        "train_loss": train_loss,
        "images_per_second": train_images / slowest if slowest > 0 else 0.0,
        "epoch_time_s": slowest,
        "rank_step_time_s": [means[0] for means in rank_means] if rank_means is not None else None,
        "rank_data_wait_s": [means[1] for means in rank_means] if rank_means is not None else None,
        "rank_compute_s": [means[2] for means in rank_means] if rank_means is not None else None,
        "lr": state.optimizer.param_groups[0]["lr"],
    }


def epoch_record(loaders: Loaders, dist: Dist, training: dict[str, Any],
                 evaluation: tuple[float, float, float]) -> dict[str, Any]:
    """Collective: one record of the epoch for the whole job: its training half and every rank's evaluation."""
    correct, eval_loss, eval_count = dist.reduce(list(evaluation), "sum")
    assert eval_count == loaders.num_eval, f"evaluated {eval_count} of {loaders.num_eval} test samples"
    return {
        **training,
        "eval_loss": eval_loss / eval_count if eval_count else None,
        "eval_accuracy": correct / eval_count if eval_count else None,
        "time": time.time(),
    }


def finish_epoch(cfg: Config, state: TrainState, loaders: Loaders, dist: Dist, hooks: Hooks) -> dict[str, Any]:
    """Collective: evaluate epoch `state.epoch`, whose training is complete (its record's training half is
    `state.pending_epoch`), log its record and save when one is due. A stop during the evaluation saves the
    epoch with its evaluation still pending and raises Stopped."""
    epoch = state.epoch
    assert state.pending_epoch is not None and state.batches_done == 0
    evaluation = evaluate_or_stop(cfg.training, state, loaders, dist, hooks, epoch)
    record = epoch_record(loaders, dist, state.pending_epoch, evaluation)
    state.pending_epoch = None
    hooks.log.log(record)
    accuracy = "n/a" if record["eval_accuracy"] is None else f"{100 * record['eval_accuracy']:.2f}%"
    log.info(
        "epoch %d/%d | train loss %.4f | eval acc %s | %.0f images/s | %.2f s",
        epoch, cfg.training.epochs, record["train_loss"], accuracy, record["images_per_second"], record["epoch_time_s"],
    )
    if epoch % cfg.checkpoint.save_every == 0 or epoch == cfg.training.epochs or hooks.save_clock.pending:
        hooks.save_or_again(state)  # not the evaluation again: its record is written
    return record


def nondeterministic_op(exc: RuntimeError, arch: str, device: torch.device) -> UserError | None:
    """torch's error for an operation without a deterministic version under --deterministic, said as what to do
    (every rank runs the same model and hits it at the same step, so each says it; None for other errors)."""
    text = str(exc)
    if "does not have a deterministic implementation" not in text:
        return None
    operation = text.split(" does not have", 1)[0].strip().split()[-1]
    return UserError(
        f"--deterministic: --arch {arch} uses {operation}, which has no deterministic implementation on {device.type}; "
        "train without --deterministic, or pick a model without that operation"
    )


def train(cfg: Config, state: TrainState, loaders: Loaders, dist: Dist, hooks: Hooks, joined: bool = False) -> TrainOutcome:
    """Collective: every rank runs the same number of steps and the same reductions, in the same order.

    `hooks.save(state)` runs at the configured epochs, at the step where rank 0's save clock says
    --save-interval has passed (mid-epoch), and at the step where the ranks agree to stop on a signal, after
    which Stopped is raised on every rank.
    """
    resumed = state.step > 0 or dist.topology.restarts > 0  # a snapshot restored (--resume with none: a first run)
    drills = drills_for(cfg.drills.inject_fault, dist.rank, resumed)
    if drills:
        if not isinstance(hooks.callbacks, Callbacks):
            hooks.callbacks = Callbacks([hooks.callbacks])
        hooks.callbacks.add(*drills)  # in place: in-job recovery's copy of the hooks tells them it recovered
    try:
        outcome = _train(cfg, state, loaders, dist, hooks, joined)
    except RuntimeError as exc:
        explained = nondeterministic_op(exc, cfg.data.model_name, dist.device) if cfg.training.deterministic else None
        if explained is None:
            raise
        raise explained from None
    # now, not at garbage collection (in-job recovery's records hold the loaders): workers ignore SIGTERM, and a
    # rank's exit handlers would wait for them forever
    stop_workers(loaders)
    return outcome


def _train(cfg: Config, state: TrainState, loaders: Loaders, dist: Dist, hooks: Hooks, joined: bool = False) -> TrainOutcome:
    timing = RankTiming(cfg.outputs.throughput_warmup_steps)
    history: list[dict[str, Any]] = []
    # A rank that joined a running job (mpiddp.trainer.join) enters at the survivors' step: no start-up agreement.
    signum = 0 if joined else hooks.stop.agreed(dist)
    if signum:  # a stop during start-up: nothing was trained since the last snapshot, which stays as it is
        raise Stopped(signal.Signals(signum).name, state.step, saved=False)
    def evaluated(current: Config) -> dict[str, Any]:
        return finish_epoch(current, state, loaders, dist, hooks)

    if state.pending_epoch is not None:  # resumed after a stop that left an epoch's evaluation undone: it comes first
        history.append(hooks.in_job(evaluated, cfg, "eval"))
    first_epoch = state.epoch + 1
    for epoch in range(first_epoch, cfg.training.epochs + 1):
        kept: list[EpochMeters] = []  # the epoch's meters, kept when an in-job recovery runs it again

        def trained(current: Config) -> None:
            totals, epoch_durations = train_epoch(current, state, loaders, dist, hooks, epoch, timing, kept)
            state.pending_epoch = training_record(state, dist, epoch, totals, epoch_durations)
            state.epoch, state.batches_done = epoch, 0

        hooks.in_job(trained, cfg, "train")
        history.append(hooks.in_job(evaluated, cfg, "eval"))
    return TrainOutcome(history, timing)
