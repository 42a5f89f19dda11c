"""A snapshot's round trip in-process: capture, write, read, restore; old and foreign files."""

import logging
import random

import numpy as np
import pytest
import torch

from mpiddp import checkpoint
from mpiddp.collective import solo_dist
from mpiddp.config import Config
from mpiddp.errors import UserError
from mpiddp.snapshot import FORMAT_VERSION, Snapshot
from mpiddp.state import build_state

pytestmark = pytest.mark.usefixtures("solo_group")


def trained_state(steps=3):
    cfg = Config(device="cpu", optimizer="adamw")
    state = build_state(cfg, solo_dist(), 10, 1, batches_per_epoch=5)
    for _ in range(steps):
        loss = state.model(torch.randn(4, 1, 8, 8)).logsumexp(dim=1).mean()
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.scheduler.step()
        state.step += 1
    state.epoch, state.batches_done = 1, 2
    return state


def test_round_trip_restores_weights_optimizer_schedule_counters_and_rng(tmp_path):
    dist = solo_dist()
    state = trained_state()
    taken = Snapshot.capture(state, dist, "digits_cnn", {"epochs": 3}, "wandb-1")
    after_capture = torch.rand(3), np.random.rand(3).tolist(), random.random()
    checkpoint.save(tmp_path, taken, dist, keep_last=2)
    path, loaded = checkpoint.restore("auto", tmp_path, "digits_cnn", dist)
    assert path.name == "snapshot-epoch0001-batch000002.pt"

    fresh = build_state(Config(device="cpu", optimizer="adamw"), dist, 10, 1, batches_per_epoch=5)
    torch.rand(100), np.random.rand(100), random.random()  # move the generators on: restoring brings them back
    loaded.restore_into(fresh, dist, seed=0, batch_size=32)
    assert torch.equal(torch.rand(3), after_capture[0])
    assert (np.random.rand(3).tolist(), random.random()) == after_capture[1:]
    assert (fresh.epoch, fresh.step, fresh.batches_done) == (1, 3, 2)
    for name, tensor in state.unwrapped.state_dict().items():
        assert torch.equal(tensor, fresh.unwrapped.state_dict()[name]), name
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 3
    assert fresh.scheduler.last_epoch == 3
    assert loaded.wandb_run_id == "wandb-1" and loaded.config == {"epochs": 3}


def test_every_field_is_written():
    payload = Snapshot.capture(trained_state(1), solo_dist(), "digits_cnn", {}, None).to_payload()
    assert payload["format"] == FORMAT_VERSION and payload["world_size"] == 1 and len(payload["rng"]) == 1
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "batches_done", "config", "wandb_run_id"} <= set(payload)


def test_a_snapshot_without_the_optional_fields_still_loads(tmp_path):
    payload = Snapshot.capture(trained_state(1), solo_dist(), "digits_cnn", {}, None).to_payload()
    for optional in ("scaler", "batches_done", "config", "wandb_run_id"):
        del payload[optional]
    torch.save(payload, tmp_path / "old.pt")
    loaded = checkpoint.load(tmp_path / "old.pt")
    assert loaded.batches_done == 0 and loaded.scaler == {}


def test_other_formats_and_plain_weights_are_refused(tmp_path):
    payload = Snapshot.capture(trained_state(1), solo_dist(), "digits_cnn", {}, None).to_payload()
    torch.save({**payload, "format": FORMAT_VERSION + 1}, tmp_path / "new.pt")
    with pytest.raises(UserError, match=f"has snapshot format {FORMAT_VERSION + 1}"):
        checkpoint.load(tmp_path / "new.pt")
    torch.save(payload["model"], tmp_path / "weights.pt")
    with pytest.raises(UserError, match="not an mpiddp snapshot"):
        checkpoint.load(tmp_path / "weights.pt")


def test_another_world_size_restarts_a_partial_epoch(caplog):
    dist = solo_dist()
    taken = Snapshot.capture(trained_state(), dist, "digits_cnn", {}, None)
    taken.world_size, taken.rng = 4, taken.rng * 4
    fresh = build_state(Config(device="cpu", optimizer="adamw"), dist, 10, 1, batches_per_epoch=5)
    with caplog.at_level(logging.WARNING):
        taken.restore_into(fresh, dist, seed=0, batch_size=32)
    assert fresh.batches_done == 0 and fresh.epoch == 1
    assert "resuming a 4-rank snapshot on 1 ranks" in caplog.text
    assert "part-way through epoch 2 on another world size: that epoch restarts" in caplog.text
