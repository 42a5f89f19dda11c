"""Run under `mpirun -np N`: the same DDP model trained side by side, its gradients all-reduced by mpiddp's
hook through gloo and through MPI (--grad-transport mpi), with each compression; rank 0 writes OUT_JSON with,
per compression, the largest gradient difference between the two paths and between ranks.

argv: OUT_JSON
"""

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

STEPS = 4


def replica(kind, dist, through_mpi):
    torch.manual_seed(1234)
    model = build_model("digits_cnn")
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.01)  # several buckets
    compression.register(ddp, kind, backend=dist.backend, mpi=dist if through_mpi else None)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)


def main(out_path):
    with FailFast() as guard:
        with distributed(DistSettings(device="cpu"), connect(guard), guard) as dist:
            results = {}
            for kind in ("none", "fp16", "bf16"):
                sides = [replica(kind, dist, through_mpi) for through_mpi in (False, True)]
                generator = torch.Generator().manual_seed(7 + dist.rank)  # each rank its own data
                grad_diff = 0.0
                largest_grad = 0.0
                for _ in range(STEPS):
                    inputs, targets = torch.randn(16, 1, 8, 8, generator=generator), torch.randint(0, 10, (16,), generator=generator)
                    grads = []
                    for model, ddp, optimizer in sides:
                        optimizer.zero_grad()
                        torch.nn.functional.cross_entropy(ddp(inputs), targets).backward()
                        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
                        optimizer.step()
                    grad_diff = max(grad_diff, float((grads[0] - grads[1]).abs().max()))
                    largest_grad = max(largest_grad, float(grads[0].abs().max()))
                params = parameters_to_vector(sides[1][0].parameters()).detach()
                everyone = dist.allgather(params.numpy())
                results[kind] = {"max_grad_diff": grad_diff, "largest_grad": largest_grad,
                                 "max_diff_between_ranks": max(float(abs(p - everyone[0]).max()) for p in everyone)}
            if dist.is_main:
                with open(out_path, "w") as out:
                    json.dump({"world_size": dist.world_size, "results": results}, out)


if __name__ == "__main__":
    main(sys.argv[1])
