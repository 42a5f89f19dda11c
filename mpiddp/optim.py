"""Optimizer and learning-rate schedule. The learning rate is for the global batch; see the README."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from mpiddp.config import Config


def build_optimizer(cfg: Config, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


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


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per optimizer step. The schedule is a function of the step and the flags, so a resumed
    run that keeps its flags continues the same curve (the snapshot stores the step)."""
    total = steps_per_epoch * cfg.epochs
    warmup = min(total, round(cfg.warmup_epochs * steps_per_epoch))

    def factor(step: int) -> float:
        return lr_factor(step, steps_per_epoch=steps_per_epoch, total_steps=total, warmup_steps=warmup,
                         schedule=cfg.schedule, lr_step_epochs=cfg.lr_step_epochs, lr_gamma=cfg.lr_gamma)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
