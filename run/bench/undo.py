"""What the undo record of a step (mpiddp.elastic.undo.StepUndo, issue 47: each step committed one step late) costs
against the step it guards, in one process, no job:

  take      StepUndo.take(): the copy of the parameters, the optimizer's state, the model's buffers (on a GPU also
            the time the call itself holds the CPU, which is what the training loop feels: the copy is queued)
  step      one training step: forward, backward, optimizer step (resnet18 from torchvision, 32x32 synthetic
            images, batch 16, cross entropy)
  restore   StepUndo.restore(), the rare path after a failure (a few runs)

for SGD with momentum and for AdamW, in turns (step, take, step, take, ...) so the drift of a shared machine hits
both alike; medians, and the median of the per-pair ratios take/step. Also the bytes the copy holds
(device_bytes) and per parameter (bytes_per_parameter).

usage: python run/bench/undo.py [--repeats 20] [--device cpu|cuda] [--threads 1] [--batch 16] [--out PATH]
Writes run/bench/results/undo-DEVICE.json. Not timed in any test: numbers for the docs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torchvision
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the checkout's mpiddp, as the other benchmarks run it

from mpiddp.elastic.undo import StepUndo, bytes_per_parameter  # noqa: E402

OPTIMIZERS: dict[str, Callable] = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2),
}


def timed(device: torch.device, work: Callable[[], object]) -> tuple[float, float]:
    """Seconds until `work` returned (what the CPU spends) and until the device finished it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    returned = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return returned, time.perf_counter() - start


def measure(name: str, device: torch.device, repeats: int, batch: int) -> dict:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    optimizer = OPTIMIZERS[name](model.parameters())
    inputs = torch.randn(batch, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    undo = StepUndo(model, optimizer)
    bytes_before_first_step = undo.device_bytes()
    for _ in range(3):  # the state exists, the copy's buffers are allocated
        step()
        undo.take()
        undo.drop()
    steps, takes, take_calls = [], [], []
    for _ in range(repeats):
        steps.append(timed(device, step)[1])
        call, done = timed(device, undo.take)
        take_calls.append(call)
        takes.append(done)
        undo.drop()
    restores = []
    for _ in range(max(3, repeats // 4)):
        undo.take()
        restores.append(timed(device, undo.restore)[1])
    return {
        "take_s": statistics.median(takes), "step_s": statistics.median(steps),
        "take_over_step": statistics.median(t / s for t, s in zip(takes, steps)),
        "take_call_s": statistics.median(take_calls), "restore_s": statistics.median(restores),
        "device_bytes": undo.device_bytes(), "device_bytes_before_first_step": bytes_before_first_step,
        "bytes_per_parameter": bytes_per_parameter(optimizer),
        "runs": {"take_s": takes, "step_s": steps, "take_call_s": take_calls, "restore_s": restores},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (the machine is shared)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    model = torchvision.models.resnet18(num_classes=10)
    result = {
        "machine": f"{os.cpu_count()} CPU cores, {gpu}", "device": str(device), "torch": torch.__version__,
        "python": platform.python_version(), "threads": args.threads, "repeats": args.repeats,
        "model": f"resnet18 (torchvision), 32x32 synthetic, batch {args.batch}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "optimizers": {name: measure(name, device, args.repeats, args.batch) for name in OPTIMIZERS},
    }
    out = args.out or REPO / "run" / "bench" / "results" / f"undo-{device.type}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({name: {key: value for key, value in numbers.items() if key != "runs"}
                      for name, numbers in result["optimizers"].items()}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
