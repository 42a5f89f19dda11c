"""The late commit's undo on a GPU (one is enough): a step's update queued behind its NCCL all-reduce, the group
aborted and built again, then the undo copy restored: the parameters are bit for bit those before the step.
Skipped, saying why, where torch sees no GPU."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from mpiddp.elastic.undo import StepUndo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch (the GPU tier runs on GPU "
                                                             "machines)"),
]


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    hashed = hashlib.sha256()
    tensors = [*model.state_dict().values()]
    tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    for tensor in tensors:
        hashed.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_garbage_update_queued_behind_an_aborted_all_reduce_is_undone_bit_for_bit(tmp_path: Path, fused: bool):
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = tdist.FileStore(str(tmp_path / "store"), 1)
    tdist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 8)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True)
        undo = StepUndo(model, optimizer)
        for step in range(4):  # the optimizer's state exists; step K = 4 is the one undone
            optimizer.zero_grad()
            model(torch.randn(32, 64, device=device)).pow(2).mean().backward()
            optimizer.step()
        before = digest(model, optimizer)
        optimizer.zero_grad()
        model(torch.randn(32, 64, device=device)).pow(2).mean().backward()
        for parameter in model.parameters():  # gradients a half-finished all-reduce could leave
            tdist.all_reduce(parameter.grad, async_op=True)
            parameter.grad.fill_(1e30)
        undo.take()
        optimizer.step()
        tdist.destroy_process_group()  # NCCL's communicator aborted, as a recovery does
        torch.cuda.synchronize()
        assert digest(model, optimizer) != before  # the garbage update did run
        undo.restore()
        torch.cuda.synchronize()
        assert digest(model, optimizer) == before
        tdist.init_process_group("nccl", store=tdist.FileStore(str(tmp_path / "store2"), 1), rank=0, world_size=1)
        optimizer.zero_grad()
        model(torch.randn(32, 64, device=device)).pow(2).mean().backward()
        optimizer.step()  # training goes on over the new group
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
