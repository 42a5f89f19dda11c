"""Gradient compression in-process: each hook trains, flags parse and validate."""

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from mpiddp import compression
from mpiddp.config import Config, ConfigError, parse_args
from mpiddp.models import build_model

pytestmark = pytest.mark.usefixtures("solo_group")


def steps(ddp, optimizer, count, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        optimizer.zero_grad()
        inputs, targets = torch.randn(16, 1, 8, 8, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        torch.nn.functional.cross_entropy(ddp(inputs), targets).backward()
        optimizer.step()


def fresh(kind):
    torch.manual_seed(0)
    model = build_model("digits_cnn")
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    state = compression.register(ddp, kind, rank=2, warmup_steps=2, backend="gloo")
    return model, ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("kind", ["fp16", "bf16", "powersgd"])
def test_each_compression_trains(kind):
    model, ddp, state, optimizer = fresh(kind)
    before = copy.deepcopy(model.state_dict())
    steps(ddp, optimizer, 4, seed=1)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (state is not None) == (kind == "powersgd")


def test_compression_flags():
    cfg = parse_args(["--grad-compression", "powersgd", "--powersgd-rank", "4", "--bucket-cap-mb", "50", "--static-graph"])
    assert (cfg.grad_compression, cfg.powersgd_rank, cfg.bucket_cap_mb, cfg.static_graph) == ("powersgd", 4, 50.0, True)
    with pytest.raises(ConfigError, match="--grad-compression must be one of none, fp16, bf16, powersgd"):
        parse_args(["--grad-compression", "int8"])
    with pytest.raises(ValueError, match="--powersgd-warmup-steps must be at least 2"):
        Config(powersgd_warmup_steps=1)
