"""The GPU kit's baseline: resnet50 in a plain torch loop, the same work as the built-in trainer's synthetic mode
with `--arch resnet50 --amp bf16 --channels-last --image-size 224 --num-classes 1000` (one random batch made once
on the GPU, cross-entropy, SGD lr 0.05 momentum 0.9 weight decay 5e-4, cudnn.benchmark).

    python3 run/gpu/resnet50_loop.py OUT.json [--steps 60 --warmup 20 --batch 256]         # no process group
    torchrun --nproc-per-node 1 run/gpu/resnet50_loop.py OUT.json --steps 1                 # DDP on NCCL (env://)
    mpirun -np 1 python3 -m mpiddp run run/gpu/resnet50_loop.py OUT.json --steps 1          # the same script

Under a launcher (WORLD_SIZE set) the model is wrapped in DDP, as a torchrun-style script would; alone it is the
plain loop. Rank 0 writes {images_per_second, first_step_done_at (epoch seconds, the GPU done with the first
step), steps, warmup, batch, ddp} to OUT.json.
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import torchvision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out of images/s (cudnn's autotuning)")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("nccl")
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=1000).to(device, memory_format=torch.channels_last)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    inputs = torch.rand((args.batch, 3, 224, 224), device=device).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch,), device=device)

    first_step_done_at, timed_from = None, None
    for step in range(args.steps):
        if step == min(args.warmup, args.steps - 1):
            torch.cuda.synchronize()
            timed_from = time.perf_counter()
            timed_steps = args.steps - step
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        if step == 0:
            torch.cuda.synchronize()
            first_step_done_at = time.time()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - timed_from
    if not distributed or dist.get_rank() == 0:
        with open(args.out, "w") as out:
            json.dump({"images_per_second": args.batch * timed_steps / seconds, "first_step_done_at": first_step_done_at,
                       "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "ddp": distributed}, out)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
