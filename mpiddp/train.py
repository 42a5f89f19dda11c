"""The training loop: steps, evaluation, and the cadence of logging and saving. It never decides *who* logs or saves."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpiddp.config import Config, FaultInjection
from mpiddp.data import Loaders
from mpiddp.log import make_progress, progress_wanted
from mpiddp.metrics import RunLogger, allreduce
from mpiddp.stopping import Stopped, StopRequest
from mpiddp.topology import Topology

log = logging.getLogger(__name__)

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class RankTiming:
    """This rank's own clock readings; gathered over MPI at the end, never synchronised per step."""

    warmup_steps: int
    step_times: list[float] = field(default_factory=list)
    images_after_warmup: int = 0
    seconds_after_warmup: float = 0.0
    first_step_done_at: float | None = None  # time.time() when the first step finished

    def record(self, seconds: float, images: int) -> None:
        if self.first_step_done_at is None:
            self.first_step_done_at = time.time()
        self.step_times.append(seconds)
        if len(self.step_times) > self.warmup_steps:
            self.images_after_warmup += images
            self.seconds_after_warmup += seconds


@dataclass
class TrainState:
    """Everything a snapshot holds, plus the wrapped model the loop runs."""

    model: nn.Module  # what forward() is called on: DDP, possibly compiled
    ddp: Any  # the DistributedDataParallel module, for no_sync()
    unwrapped: nn.Module  # the plain model: evaluation and state_dict
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    epoch: int = 0  # completed epochs
    step: int = 0  # completed optimizer steps
    batches_done: int = 0  # batches already trained in epoch `epoch + 1` (a run stopped part-way)


@dataclass
class TrainOutcome:
    epochs: list[dict[str, Any]]
    timing: RankTiming


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """One plain optimisation step; DDP averages the gradients across ranks inside backward()."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def autocast_for(amp: str, device: torch.device) -> Any:
    if amp == "off":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, device: torch.device, amp: str = "off",
             memory_format: torch.memory_format = torch.contiguous_format,
             heartbeat: Callable[[str, int], None] = lambda phase, step: None,
             step: int = 0) -> tuple[float, float, float]:
    """(correct, summed loss, count) over this rank's eval shard.

    Runs the unwrapped module: DDP's forward may broadcast buffers, a collective that would deadlock
    when ranks hold different numbers of eval batches.
    """
    model.eval()
    correct = torch.zeros((), device=device)
    loss_sum = torch.zeros((), device=device)
    count = 0
    for inputs, targets in loader:
        heartbeat("eval", step)
        inputs = inputs.to(device, non_blocking=True, memory_format=memory_format)
        targets = targets.to(device, non_blocking=True)
        with autocast_for(amp, device):
            logits = model(inputs)
        loss_sum += nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
        correct += (logits.argmax(dim=1) == targets).sum()
        count += len(targets)
    model.train()
    return float(correct.item()), float(loss_sum.item()), float(count)


def inject_fault(fault: FaultInjection | None, rank: int, step: int) -> None:
    """Fail on purpose (--inject-fault), to prove that one rank's failure ends the whole job."""
    if fault is None or not fault.hits(rank, step):
        return
    log.warning("injecting fault %r at step %d", fault.kind, step)
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if fault.kind == "stall":
        threading.Event().wait()  # block forever, as a rank stuck in I/O or a deadlock would
    sys.exit(0 if fault.kind == "exit0" else 1)


def optimizer_steps_per_epoch(num_batches: int, grad_accum: int) -> int:
    return -(-num_batches // grad_accum)


def train(
    cfg: Config,
    state: TrainState,
    loaders: Loaders,
    topo: Topology,
    comm: Any,
    device: torch.device,
    run_logger: RunLogger,
    save: Callable[[TrainState], None],
    stop: StopRequest,
    heartbeat: Callable[[str, int], None] = lambda phase, step: None,
) -> TrainOutcome:
    """Collective: every rank runs the same number of steps and the same reductions, in the same order.

    `save(state)` is called at the configured epochs, and at the step where the ranks agree to stop on a
    signal; then Stopped is raised on every rank.
    """
    loss_fn = nn.CrossEntropyLoss()
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    timing = RankTiming(cfg.throughput_warmup_steps)
    history: list[dict[str, Any]] = []
    show_progress = progress_wanted(cfg.progress) and topo.is_main
    for epoch in range(state.epoch + 1, cfg.epochs + 1):
        skipped = state.batches_done
        loaders.set_epoch(epoch, skip_batches=skipped)
        num_batches = len(loaders.train)
        steps_per_epoch = optimizer_steps_per_epoch(num_batches, cfg.grad_accum)
        state.model.train()
        progress = make_progress(show_progress, steps_per_epoch, f"epoch {epoch}/{cfg.epochs}")
        epoch_loss = torch.zeros((), device=device)
        window_loss = torch.zeros((), device=device)
        epoch_images = window_images = group_images = 0
        epoch_seconds = window_seconds = 0.0
        epoch_step_times: list[float] = []
        tick = time.perf_counter()
        for index, (inputs, targets) in enumerate(loaders.train):
            inputs = inputs.to(device, non_blocking=True, memory_format=memory_format)
            targets = targets.to(device, non_blocking=True)
            group_start = index - index % cfg.grad_accum
            group_size = min(cfg.grad_accum, num_batches - group_start)
            finishes_group = index + 1 == group_start + group_size
            # Gradients all-reduce only on the last micro-batch of a group.
            with nullcontext() if finishes_group else state.ddp.no_sync():
                with autocast_for(cfg.amp, device):
                    loss = loss_fn(state.model(inputs), targets)
                state.scaler.scale(loss / group_size).backward()
            batch = len(targets)
            epoch_loss += loss.detach().float() * batch
            window_loss += loss.detach().float() * batch
            group_images += batch
            if not finishes_group:
                continue
            state.scaler.step(state.optimizer)
            state.scaler.update()
            state.optimizer.zero_grad(set_to_none=True)
            state.scheduler.step()
            state.step += 1
            inject_fault(cfg.inject_fault, topo.rank, state.step)
            epoch_images += group_images
            window_images += group_images
            now = time.perf_counter()
            elapsed, tick = now - tick, now
            epoch_seconds += elapsed
            window_seconds += elapsed
            epoch_step_times.append(elapsed)
            timing.record(elapsed, group_images)
            group_images = 0
            progress.update(1)
            heartbeat("train", state.step)
            signum = stop.agreed(comm)
            if signum:
                progress.close()
                state.batches_done = skipped + index + 1
                save(state)
                raise Stopped(signal.Signals(signum).name, state.step)
            if state.step % cfg.log_every == 0:
                # The only per-window sync: one .item() and two small MPI reductions.
                loss_total, images = allreduce(comm, [window_loss.item(), window_images], "sum")
                (slowest,) = allreduce(comm, [window_seconds], "max")
                record = {
                    "kind": "step",
                    "epoch": epoch,
                    "step": state.step,
                    "loss": loss_total / images,
                    "lr": state.optimizer.param_groups[0]["lr"],
                    "images_per_second": images / slowest if slowest > 0 else 0.0,
                    "time": time.time(),
                }
                run_logger.log(record)
                progress.update(0, postfix=f"loss {record['loss']:.4f}")
                window_loss.zero_()
                window_images, window_seconds = 0, 0.0
        progress.close()

        if loaders.eval is not None:
            correct, eval_loss, eval_count = evaluate(
                state.unwrapped, loaders.eval, device, cfg.amp, memory_format, heartbeat, state.step
            )
        else:
            correct = eval_loss = eval_count = 0.0
        train_loss_sum, train_images, correct, eval_loss, eval_count = allreduce(
            comm, [epoch_loss.item(), epoch_images, correct, eval_loss, eval_count], "sum"
        )
        (slowest_epoch,) = allreduce(comm, [epoch_seconds], "max")
        rank_means = comm.allgather(sum(epoch_step_times) / max(1, len(epoch_step_times)))
        assert eval_count == loaders.num_eval, f"evaluated {eval_count} of {loaders.num_eval} test samples"
        record = {
            "kind": "epoch",
            "epoch": epoch,
            "step": state.step,
            "train_loss": train_loss_sum / max(1.0, train_images),
            "eval_loss": eval_loss / eval_count if eval_count else None,
            "eval_accuracy": correct / eval_count if eval_count else None,
            "images_per_second": train_images / slowest_epoch if slowest_epoch > 0 else 0.0,
            "epoch_time_s": slowest_epoch,
            "rank_step_time_s": rank_means,
            "lr": state.optimizer.param_groups[0]["lr"],
            "time": time.time(),
        }
        history.append(record)
        run_logger.log(record)
        accuracy = f"{100 * record['eval_accuracy']:.2f}%" if eval_count else "n/a"
        log.info(
            "epoch %d/%d | train loss %.4f | eval acc %s | %.0f images/s | %.2f s",
            epoch, cfg.epochs, record["train_loss"], accuracy, record["images_per_second"], slowest_epoch,
        )
        state.epoch, state.batches_done = epoch, 0
        if epoch % cfg.save_every == 0 or epoch == cfg.epochs:
            save(state)
    return TrainOutcome(history, timing)
