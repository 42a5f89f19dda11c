"""Run under `mpirun -np N`: mpiddp's own train_step on N DDP ranks (with ACCUM micro-batches per step)
vs one process taking one step per concatenated global batch.

argv: OUT_JSON ACCUM [DEVICE] (cpu, the default, or cuda: NCCL, one GPU per rank). Rank 0 writes the largest parameter difference between ranks, between rank 0 and
the single-process reference, and how far training moved the parameters.
"""

import copy
import json
import sys

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector

from mpiddp.job import compression
from mpiddp.job.bootstrap import connect, distributed
from mpiddp.job.failfast import FailFast
from mpiddp.job.flags import DistSettings
from mpiddp.trainer.models import build_model
from mpiddp.trainer.state import TrainState
from mpiddp.trainer.train import train_step

STEPS, MICRO_BATCH = 6, 8


def state_for(model, ddp=None, backend="gloo"):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    # mpiddp's own communication hook (plain all-reduce) is what the DDP side runs, as in a job
    hook = compression.register(ddp, "none", backend=backend) if ddp is not None else None
    return TrainState(ddp or model, ddp, model, optimizer, schedule, torch.amp.GradScaler("cpu", enabled=False), hook)


def main(out_path: str, accum: int, device: str) -> None:
    with FailFast() as guard:
        with distributed(DistSettings(device=device), connect(guard), guard) as dist:
            torch.manual_seed(1234)
            # float64: differences come from the algorithm, not rounding
            model = build_model("digits_cnn").double().to(dist.device)
            reference = copy.deepcopy(model)
            initial = parameters_to_vector(model.parameters()).detach().cpu().clone()
            device_ids = [dist.device.index] if dist.device.type == "cuda" else None
            state = state_for(model, DistributedDataParallel(model, device_ids=device_ids), dist.backend)
            generator = torch.Generator().manual_seed(99)
            chunks = dist.world_size * accum
            for _ in range(STEPS):
                inputs = torch.randn(MICRO_BATCH * chunks, 1, 8, 8, generator=generator, dtype=torch.float64)
                targets = torch.randint(0, 10, (MICRO_BATCH * chunks,), generator=generator)
                pieces = list(zip(inputs.chunk(chunks), targets.chunk(chunks)))
                train_step(state, pieces[dist.rank * accum:(dist.rank + 1) * accum], dist.device)
            params = parameters_to_vector(model.parameters()).detach().cpu()
            everyone = dist.allgather(params.numpy())

            generator.manual_seed(99)
            reference_state = state_for(reference)
            for _ in range(STEPS):
                inputs = torch.randn(MICRO_BATCH * chunks, 1, 8, 8, generator=generator, dtype=torch.float64)
                targets = torch.randint(0, 10, (MICRO_BATCH * chunks,), generator=generator)
                train_step(reference_state, [(inputs, targets)], dist.device)
            expected = parameters_to_vector(reference.parameters()).detach().cpu()
            result = {
                "world_size": dist.world_size,
                "steps": state.step,
                "max_diff_between_ranks": max(float(abs(p - everyone[0]).max()) for p in everyone),
                "max_diff_to_reference": float((params - expected).abs().max()),
                "max_change_from_init": float((params - initial).abs().max()),
            }
            if dist.is_main:
                with open(out_path, "w") as out:
                    json.dump(result, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "cpu")
