"""The training loop: steps, evaluation, and the cadence of logging. It never decides *who* logs."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mpiddp.config import Config, FaultInjection
from mpiddp.data import Loaders
from mpiddp.log import make_progress, progress_wanted
from mpiddp.metrics import RunLogger, allreduce
from mpiddp.topology import Topology

log = logging.getLogger(__name__)


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
class TrainOutcome:
    epochs: list[dict[str, Any]]
    timing: RankTiming


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """One optimisation step; DDP averages the gradients across ranks inside backward()."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, device: torch.device) -> tuple[float, float, float]:
    """(correct, summed loss, count) over this rank's eval shard.

    Runs the unwrapped module: DDP's forward may broadcast buffers, a collective that would deadlock
    when ranks hold different numbers of eval batches.
    """
    model.eval()
    correct = torch.zeros((), device=device)
    loss_sum = torch.zeros((), device=device)
    count = 0
    for inputs, targets in loader:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        logits = model(inputs)
        loss_sum += nn.functional.cross_entropy(logits, targets, reduction="sum")
        correct += (logits.argmax(dim=1) == targets).sum()
        count += len(targets)
    model.train()
    return float(correct.item()), float(loss_sum.item()), float(count)


def inject_fault(fault: FaultInjection | None, rank: int, step: int) -> None:
    """Fail on purpose (--inject-fault), to prove that one rank's failure ends the whole job."""
    if fault is None or fault.rank != rank or fault.step != step:
        return
    log.warning("injecting fault %r at step %d", fault.kind, step)
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    sys.exit(0 if fault.kind == "exit0" else 1)


def train(
    cfg: Config,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loaders: Loaders,
    topo: Topology,
    comm: Any,
    device: torch.device,
    run_logger: RunLogger,
) -> TrainOutcome:
    """Collective: every rank runs the same number of steps and the same reductions, in the same order."""
    loss_fn = nn.CrossEntropyLoss()
    steps_per_epoch = len(loaders.train)
    timing = RankTiming(cfg.throughput_warmup_steps)
    history: list[dict[str, Any]] = []
    step = 0
    unwrapped = getattr(model, "module", model)
    show_progress = progress_wanted(cfg.progress) and topo.is_main
    for epoch in range(1, cfg.epochs + 1):
        loaders.train_sampler.set_epoch(epoch)
        model.train()
        progress = make_progress(show_progress, steps_per_epoch, f"epoch {epoch}/{cfg.epochs}")
        epoch_loss = torch.zeros((), device=device)
        window_loss = torch.zeros((), device=device)
        epoch_images = window_images = 0
        epoch_seconds = window_seconds = 0.0
        tick = time.perf_counter()
        for inputs, targets in loaders.train:
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            loss = train_step(model, optimizer, loss_fn, inputs, targets)
            step += 1
            inject_fault(cfg.inject_fault, topo.rank, step)
            batch = len(targets)
            epoch_loss += loss * batch
            window_loss += loss * batch
            epoch_images += batch
            window_images += batch
            now = time.perf_counter()
            elapsed, tick = now - tick, now
            epoch_seconds += elapsed
            window_seconds += elapsed
            timing.record(elapsed, batch)
            progress.update(1)
            if step % cfg.log_every == 0:
                # The only per-window sync: one .item() and one small MPI reduction.
                loss_total, images = allreduce(comm, [window_loss.item(), window_images], "sum")
                (slowest,) = allreduce(comm, [window_seconds], "max")
                record = {
                    "kind": "step",
                    "epoch": epoch,
                    "step": step,
                    "loss": loss_total / images,
                    "lr": optimizer.param_groups[0]["lr"],
                    "images_per_second": images / slowest if slowest > 0 else 0.0,
                    "time": time.time(),
                }
                run_logger.log(record)
                progress.update(0, postfix=f"loss {record['loss']:.4f}")
                window_loss.zero_()
                window_images, window_seconds = 0, 0.0
        progress.close()

        correct, eval_loss, eval_count = evaluate(unwrapped, loaders.eval, device)
        train_loss_sum, train_images, correct, eval_loss, eval_count = allreduce(
            comm, [epoch_loss.item(), epoch_images, correct, eval_loss, eval_count], "sum"
        )
        (slowest_epoch,) = allreduce(comm, [epoch_seconds], "max")
        assert eval_count == loaders.num_eval, f"evaluated {eval_count} of {loaders.num_eval} test samples"
        record = {
            "kind": "epoch",
            "epoch": epoch,
            "step": step,
            "train_loss": train_loss_sum / train_images,
            "eval_loss": eval_loss / eval_count,
            "eval_accuracy": correct / eval_count,
            "images_per_second": train_images / slowest_epoch if slowest_epoch > 0 else 0.0,
            "epoch_time_s": slowest_epoch,
            "time": time.time(),
        }
        history.append(record)
        run_logger.log(record)
        log.info(
            "epoch %d/%d | train loss %.4f | eval loss %.4f | eval acc %.2f%% | %.0f images/s | %.2f s",
            epoch, cfg.epochs, record["train_loss"], record["eval_loss"], 100 * record["eval_accuracy"],
            record["images_per_second"], slowest_epoch,
        )
    return TrainOutcome(history, timing)
