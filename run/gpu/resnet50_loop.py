"""The GPU kit's baseline: resnet50 in a plain torch loop, the same work as the built-in trainer's synthetic mode
with `--arch resnet50 --amp bf16 --channels-last --image-size 224 --num-classes 1000` (one random batch made once
on the GPU, cross-entropy, SGD lr 0.05 momentum 0.9 weight decay 5e-4, cudnn.benchmark).

    python3 run/gpu/resnet50_loop.py OUT.json [--steps 60 --warmup 20 --batch 256]         # no process group
    torchrun --nproc-per-node 1 run/gpu/resnet50_loop.py OUT.json --steps 1                 # DDP on NCCL (env://)
    mpirun -np 1 python3 -m mpiddp run run/gpu/resnet50_loop.py OUT.json --steps 1          # the same script
    mpirun --with-ft ulfm -np 1 python3 -m mpiddp run run/gpu/resnet50_loop.py OUT.json --mpiddp-wrappers
                                                            # recoverable: mpiddp's DDP wrapper and optimizer

Under a launcher (WORLD_SIZE set) the model is wrapped in DDP, as a torchrun-style script would (with
`--mpiddp-wrappers`, mpiddp.DistributedDataParallel and mpiddp.Optimizer: in-job recovery under `mpirun --with-ft
ulfm`, torch's own DDP and optimizer otherwise); alone it is the plain loop. `--device cpu --image-size 32` runs
the same code on CPU (gloo), for the kit's tests on machines without a GPU.

The steps after `--warmup` are timed two ways, both real clocks: the window (the device synchronised at its start
and end, perf_counter) gives images_per_second and per_step_s (window / timed steps); one CUDA event after each
step (host clock on CPU) gives each step's own duration, read once at the end, never synchronising per step.
Rank 0 writes {images_per_second, per_step_s, timed_steps, step_s {p50, min, max}, first_step_done_at (epoch
seconds, the device done with the first step), steps, warmup, batch, ddp, wrappers, skipped, device} to OUT.json.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
import torchvision


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of images/s (cudnn's autotuning)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--mpiddp-wrappers", action="store_true", help="mpiddp.DistributedDataParallel and "
                        "mpiddp.Optimizer instead of torch's (needs a launcher)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--image-size", type=int, default=224)
    args = parser.parse_args()
    if args.mpiddp_wrappers and "WORLD_SIZE" not in os.environ:
        parser.error("--mpiddp-wrappers needs a launcher (mpiddp run, torchrun): WORLD_SIZE is not set")
    return args


def build(args: argparse.Namespace, device: torch.device, distributed: bool) -> tuple:
    """The model (in DDP under a launcher: torch's, or mpiddp's with --mpiddp-wrappers), its optimizer, one batch."""
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000).to(device, memory_format=torch.channels_last)
    if distributed:
        if args.mpiddp_wrappers:
            from mpiddp import DistributedDataParallel
        else:
            from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    if args.mpiddp_wrappers:
        from mpiddp import Optimizer

        optimizer = Optimizer(optimizer, model)
    size = args.image_size
    inputs = torch.rand((args.batch, 3, size, size), device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch,), device=device)
    return model, optimizer, inputs, labels


def timed_loop(args: argparse.Namespace, device: torch.device, model, optimizer, inputs, labels) -> dict:
    """Run the steps; time those after the warm-up as a window and one by one (see the module's docstring)."""
    cuda = device.type == "cuda"

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    def mark() -> "torch.cuda.Event | float":  # a step's end: on the device's timeline where there is one
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    first_step_done_at, timed_from, marks = None, None, []
    for step in range(args.steps):
        if step == min(args.warmup, args.steps - 1):
            synchronize()
            timed_from = time.perf_counter()
            timed_steps = args.steps - step
            marks.append(mark())
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        if timed_from is not None:
            marks.append(mark())
        if step == 0:
            synchronize()
            first_step_done_at = time.time()
    synchronize()
    seconds = time.perf_counter() - timed_from
    if cuda:
        steps_s = [start.elapsed_time(end) / 1000.0 for start, end in zip(marks, marks[1:])]
    else:
        steps_s = [end - start for start, end in zip(marks, marks[1:])]
    return {"images_per_second": args.batch * timed_steps / seconds, "per_step_s": seconds / timed_steps,
            "timed_steps": timed_steps,
            "step_s": {"p50": statistics.median(steps_s), "min": min(steps_s), "max": max(steps_s)},
            "first_step_done_at": first_step_done_at}


def main() -> None:
    args = parse_args()
    distributed = "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model, optimizer, inputs, labels = build(args, device, distributed)
    result = timed_loop(args, device, model, optimizer, inputs, labels)
    if not distributed or dist.get_rank() == 0:
        with open(args.out, "w") as out:
            json.dump({**result, "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "ddp": distributed,
                       "wrappers": args.mpiddp_wrappers, "skipped": getattr(optimizer, "skipped", 0),
                       "device": args.device}, out)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
