"""Run under `mpirun -np N`: N DDP ranks vs one process on the concatenated batches.

Writes JSON to argv[1] (rank 0) with the largest parameter difference between ranks, between rank 0 and
the single-process reference, and how far training moved the parameters.
"""

import copy
import json
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector

from mpiddp.bootstrap import FailFast, distributed
from mpiddp.config import Config
from mpiddp.models import build_model
from mpiddp.topology import discover, init_mpi
from mpiddp.train import train_step

STEPS, PER_RANK_BATCH = 6, 8


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)


def main(out_path: str) -> None:
    with FailFast() as guard:
        comm = guard.comm = init_mpi()
        topo = discover(comm)
        with distributed(Config(device="cpu"), topo, comm):
            torch.manual_seed(1234)
            model = build_model("digits_cnn").double()  # float64: differences come from the algorithm, not rounding
            reference = copy.deepcopy(model)
            initial = parameters_to_vector(model.parameters()).detach().clone()
            ddp = DistributedDataParallel(model)
            optimizer = make_optimizer(ddp.parameters())
            loss_fn = nn.CrossEntropyLoss()
            generator = torch.Generator().manual_seed(99)
            batch = PER_RANK_BATCH * topo.world_size
            batches = [
                (torch.randn(batch, 1, 8, 8, generator=generator, dtype=torch.float64),
                 torch.randint(0, 10, (batch,), generator=generator))
                for _ in range(STEPS)
            ]
            mine = slice(topo.rank * PER_RANK_BATCH, (topo.rank + 1) * PER_RANK_BATCH)
            for inputs, targets in batches:
                train_step(ddp, optimizer, loss_fn, inputs[mine], targets[mine])
            params = parameters_to_vector(model.parameters()).detach()
            everyone = comm.allgather(params.numpy())

            reference_optimizer = make_optimizer(reference.parameters())
            for inputs, targets in batches:
                train_step(reference, reference_optimizer, loss_fn, inputs, targets)
            expected = parameters_to_vector(reference.parameters()).detach()
            result = {
                "world_size": topo.world_size,
                "max_diff_between_ranks": max(float(abs(p - everyone[0]).max()) for p in everyone),
                "max_diff_to_reference": float((params - expected).abs().max()),
                "max_change_from_init": float((params - initial).abs().max()),
            }
            if topo.is_main:
                with open(out_path, "w") as out:
                    json.dump(result, out)


if __name__ == "__main__":
    main(sys.argv[1])
