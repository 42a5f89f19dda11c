"""The job's configuration: one dataclass, validated on construction, built from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from mpiddp.errors import UserError

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
PROGRESS = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")
FAULT_KINDS = ("raise", "exit0", "exit1")
MASTER_ADDR_ENV = "MPIDDP_MASTER_ADDR"


class ConfigError(UserError):
    """A bad flag or flag combination: reported as one line, exit status 2."""


class HelpRequested(Exception):
    """`--help` or `--version`: rank 0 prints the text, every rank exits 0."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


@dataclass(frozen=True)
class FaultInjection:
    """A deliberate failure for testing the abort path: `KIND:RANK:STEP` (KIND: raise, exit0, exit1)."""

    kind: str
    rank: int
    step: int

    @classmethod
    def parse(cls, spec: str) -> FaultInjection:
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in FAULT_KINDS:
            raise ValueError(f"--inject-fault must be KIND:RANK:STEP with KIND in {FAULT_KINDS}, got {spec!r}")
        try:
            rank, step = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"--inject-fault RANK and STEP must be integers, got {spec!r}") from None
        if rank < 0 or step < 0:
            raise ValueError(f"--inject-fault RANK and STEP must be >= 0, got {spec!r}")
        return cls(parts[0], rank, step)


@dataclass(frozen=True)
class Config:
    """Everything one training job needs; every rank builds the same one from the same flags."""

    epochs: int = 15
    batch_size: int = 32
    eval_batch_size: int = 256
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0
    run_dir: str | None = None
    runs_root: str = "runs"
    log_every: int = 10
    throughput_warmup_steps: int = 5
    device: str = "auto"
    backend: str = "auto"
    master_addr: str | None = None
    rendezvous_timeout_s: float = 120.0
    collective_timeout_s: float = 600.0
    num_threads: int | None = None
    progress: str = "auto"
    log_level: str = "info"
    inject_fault: FaultInjection | None = None

    def __post_init__(self) -> None:
        positive = {
            "--epochs": self.epochs,
            "--batch-size": self.batch_size,
            "--eval-batch-size": self.eval_batch_size,
            "--log-every": self.log_every,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if not 0 < self.lr <= 10:
            raise ValueError(f"--lr must be in (0, 10], got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.throughput_warmup_steps < 0:
            raise ValueError(f"--throughput-warmup-steps must be >= 0, got {self.throughput_warmup_steps}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.device == "cpu" and self.backend == "nccl":
            raise ValueError("--backend nccl needs GPUs: use --device cuda (or auto on a GPU host), or --backend gloo")
        if self.rendezvous_timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ValueError("--rendezvous-timeout and --collective-timeout must be positive seconds")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be at least 1, got {self.num_threads}")
        if self.progress not in PROGRESS:
            raise ValueError(f"--progress must be one of {', '.join(PROGRESS)}, got {self.progress!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.master_addr is not None and not self.master_addr.strip():
            raise ValueError("--master-addr is empty: give a host name or IP address, or leave it out")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view for logs, summaries and wandb."""
        out = dataclasses.asdict(self)
        out["inject_fault"] = None if self.inject_fault is None else dataclasses.asdict(self.inject_fault)
        return out


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting, so the caller decides which rank speaks."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see --help)")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise HelpRequested(message or "")

    def print_help(self, file: Any = None) -> None:
        raise HelpRequested(self.format_help())


def build_parser() -> argparse.ArgumentParser:
    from mpiddp import __version__

    parser = _Parser(
        prog="mpirun -np N python -m mpiddp",
        description="Train a model with PyTorch DDP on every rank that mpirun started.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mpiddp {__version__}")
    d = Config()

    train = parser.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training set")
    train.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per rank per step")
    train.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size, help="samples per rank per eval step")
    train.add_argument("--lr", type=float, default=d.lr, help="SGD learning rate")
    train.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum")
    train.add_argument("--weight-decay", type=float, default=d.weight_decay, help="L2 weight decay")
    train.add_argument("--seed", type=int, default=d.seed, help="seed for weights, data order and split")

    out = parser.add_argument_group("outputs")
    out.add_argument("--run-dir", default=None, help="where metrics.jsonl and summary.json go (default: runs/<timestamp>)")
    out.add_argument("--runs-root", default=d.runs_root, help="parent of the default run directory")
    out.add_argument("--log-every", type=int, default=d.log_every, help="steps between metric lines")
    out.add_argument(
        "--throughput-warmup-steps",
        type=int,
        default=d.throughput_warmup_steps,
        help="first steps left out of images/s",
    )
    out.add_argument("--progress", default=d.progress, help="rank 0's progress bar: auto (on a terminal, not in CI), on, off")
    out.add_argument("--no-progress", dest="progress", action="store_const", const="off", help="same as --progress off")
    out.add_argument("--log-level", default=d.log_level, choices=LOG_LEVELS, help="rank 0's level; others log warnings")

    dist = parser.add_argument_group("distributed")
    dist.add_argument("--device", default=d.device, help=f"one of {', '.join(DEVICES)}")
    dist.add_argument("--backend", default=d.backend, help=f"one of {', '.join(BACKENDS)}")
    dist.add_argument(
        "--master-addr",
        default=os.environ.get(MASTER_ADDR_ENV),
        help=f"address rank 0 advertises for the rendezvous (env {MASTER_ADDR_ENV}; default: chosen automatically)",
    )
    dist.add_argument(
        "--rendezvous-timeout",
        dest="rendezvous_timeout_s",
        type=float,
        default=d.rendezvous_timeout_s,
        help="seconds a rank waits to reach rank 0's store",
    )
    dist.add_argument(
        "--collective-timeout",
        dest="collective_timeout_s",
        type=float,
        default=d.collective_timeout_s,
        help="seconds before a stuck gloo/NCCL collective fails",
    )
    dist.add_argument("--num-threads", type=int, default=None, help="torch CPU threads per rank (default: fair share)")
    # For tests of the abort path; documented in the README, kept out of --help.
    dist.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    """Build the Config from flags. Raises ConfigError (one-line message) or HelpRequested."""
    namespace = build_parser().parse_args(argv)
    values = vars(namespace)
    try:
        if values["inject_fault"] is not None:
            values["inject_fault"] = FaultInjection.parse(values["inject_fault"])
        return Config(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
