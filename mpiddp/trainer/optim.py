"""Optimizer and learning-rate schedule. The learning rate is for the global batch; see the README."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from mpiddp.trainer.config import TrainingSettings


def build_optimizer(training: TrainingSettings, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if training.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=training.lr, weight_decay=training.weight_decay)
    return torch.optim.SGD(params, lr=training.lr, momentum=training.momentum, weight_decay=training.weight_decay)


def lr_factor(step: int, *, steps_per_epoch: int, total_steps: int, warmup_steps: int, schedule: str,
              lr_step_epochs: int, lr_gamma: float) -> float:
    """Multiplier of the peak learning rate before optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "cosine":
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    if schedule == "step":
        return lr_gamma ** (step // (steps_per_epoch * lr_step_epochs))
    return 1.0


def build_scheduler(training: TrainingSettings, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step. The schedule is a function of the step and the flags; a resumed run
    is put at its position on this curve by `apply_on_resume`."""
    total = steps_per_epoch * training.epochs
    warmup = min(total, round(training.warmup_epochs * steps_per_epoch))

    def factor(step: int) -> float:
        return lr_factor(step, steps_per_epoch=steps_per_epoch, total_steps=total, warmup_steps=warmup,
                         schedule=training.schedule, lr_step_epochs=training.lr_step_epochs, lr_gamma=training.lr_gamma)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def apply_on_resume(training: TrainingSettings, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                    position: int) -> float:
    """After a snapshot's optimizer and schedule state are loaded, which bring back *its* learning rate, momentum
    and weight decay: this job's values, and this job's schedule (length, warm-up, kind) at `position` optimizer
    steps. With unchanged flags nothing moves. Returns the learning rate of the next step."""
    for group in optimizer.param_groups:
        group["initial_lr"] = training.lr
        group["weight_decay"] = training.weight_decay
        if "momentum" in group:  # SGD; AdamW has no momentum setting (its betas are fixed)
            group["momentum"] = training.momentum
    scheduler.base_lrs = [training.lr for _ in optimizer.param_groups]
    scheduler.last_epoch = position - 1
    scheduler.step()  # sets every group's lr to base_lr x factor(position), as a straight run would have it
    return optimizer.param_groups[0]["lr"]
