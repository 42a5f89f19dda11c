"""A snapshot's round trip in-process: capture, write, read, restore; old and foreign files."""

import dataclasses
import logging
import random

import numpy as np
import pytest
import torch

from mpiddp.errors import UserError
from mpiddp.job.collective import solo_dist
from mpiddp.trainer import checkpoint
from mpiddp.job.flags import flag_fields
from mpiddp.trainer.config import Config
from mpiddp.trainer.snapshot import FORMAT_VERSION, Snapshot
from mpiddp.trainer.state import build_state

pytestmark = pytest.mark.usefixtures("solo_group")


def trained_state(steps=3):
    cfg = Config.of(device="cpu", optimizer="adamw")
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

    fresh = build_state(Config.of(device="cpu", optimizer="adamw"), dist, 10, 1, batches_per_epoch=5)
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
    fresh = build_state(Config.of(device="cpu", optimizer="adamw"), dist, 10, 1, batches_per_epoch=5)
    with caplog.at_level(logging.WARNING):
        taken.restore_into(fresh, dist, seed=0, batch_size=32)
    assert fresh.batches_done == 0 and fresh.epoch == 1
    assert "resuming a 4-rank snapshot on 1 ranks" in caplog.text
    assert "part-way through epoch 2 on another world size: that epoch restarts" in caplog.text


# --- settings changed on resume: applied as a straight run with the new flags would have them, or refused ---------

FIRST = dict(device="cpu", wandb="disabled", progress="off", epochs=4, lr=0.05, batch_size=32)
BATCHES_AT_32 = 10  # batches per epoch at --batch-size 32 (a made-up loader: only the arithmetic matters)


def batches_per_epoch(cfg):
    return BATCHES_AT_32 * 32 // cfg.training.batch_size


def first_job(tmp_path, batches_done=0, **settings):
    """Two epochs (plus `batches_done` batches) of job A, saved as a snapshot in tmp_path."""
    dist, cfg = solo_dist(), Config.of(**{**FIRST, **settings})
    state = build_state(cfg, dist, 10, 1, batches_per_epoch=batches_per_epoch(cfg))
    for _ in range(2 * BATCHES_AT_32 + batches_done):
        state.optimizer.step()  # no gradients: only the schedule moves
        state.scheduler.step()
        state.step += 1
    state.epoch, state.batches_done = 2, batches_done
    checkpoint.save(tmp_path, Snapshot.capture(state, dist, cfg.data.model_name, cfg.to_dict(), None), dist, keep_last=3)
    return cfg


def resumed_job(tmp_path, cfg):
    from mpiddp.trainer.run import resume

    state = build_state(cfg, solo_dist(), 10, 1, batches_per_epoch=batches_per_epoch(cfg))
    assert resume(cfg, solo_dist(), state, tmp_path) is not None
    return state


def straight_run_at(cfg, steps):
    """What a run started with `cfg` has after `steps` optimizer steps."""
    state = build_state(cfg, solo_dist(), 10, 1, batches_per_epoch=batches_per_epoch(cfg))
    for _ in range(steps):
        state.optimizer.step()
        state.scheduler.step()
    return state


def optimizer_settings(state, steps=8):
    """The optimizer's settings now and the learning rates of the next `steps` steps."""
    groups = [{k: v for k, v in g.items() if k in ("lr", "momentum", "weight_decay")} for g in state.optimizer.param_groups]
    rates = []
    for _ in range(steps):
        state.optimizer.step()
        state.scheduler.step()
        rates.append(state.optimizer.param_groups[0]["lr"])
    return groups, state.scheduler.base_lrs, rates


@pytest.mark.parametrize("first, changed, position", [
    ({}, {"lr": 0.5}, 20),  # issue 19: epochs 3-4 ran on 0.05's cosine while the log said 0.5
    ({}, {"momentum": 0.5}, 20),
    ({}, {"weight_decay": 1e-2}, 20),
    ({}, {"epochs": 8}, 20),  # a longer cosine
    ({}, {"warmup_epochs": 3.0}, 20),
    ({}, {"schedule": "constant"}, 20),
    ({"schedule": "step"}, {"lr_step_epochs": 1}, 20),
    ({"schedule": "step", "lr_step_epochs": 1}, {"lr_gamma": 0.5}, 20),
    ({}, {"batch_size": 64}, 10),  # 5 batches per epoch now: 2 epochs are 10 steps into the new curve
    ({}, {"grad_accum": 3}, 8),  # ceil(10 / 3) = 4 steps per epoch
    ({}, {"lr": 0.5, "epochs": 6, "momentum": 0.8}, 20),
], ids=lambda value: ",".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value))
def test_a_setting_changed_on_resume_is_applied(tmp_path, caplog, first, changed, position):
    before = first_job(tmp_path, **first)
    after = before.replace(resume="auto", **changed)
    with caplog.at_level(logging.WARNING):
        resumed = resumed_job(tmp_path, after)
    for key, value in changed.items():
        assert f"resuming with --{key.replace('_', '-')} changed from {before.to_dict()[key]!r} to {value!r}" in caplog.text
    assert optimizer_settings(resumed) == optimizer_settings(straight_run_at(after, position))
    assert optimizer_settings(resumed)[1] == [after.training.lr]


def test_unchanged_settings_continue_the_same_curve(tmp_path):
    before = first_job(tmp_path, batches_done=4)
    resumed = resumed_job(tmp_path, before.replace(resume="auto"))
    assert resumed.scheduler.last_epoch == resumed.step == 24
    assert optimizer_settings(resumed) == optimizer_settings(straight_run_at(before, 24))


def test_another_batch_size_restarts_a_partial_epoch(tmp_path, caplog):
    before = first_job(tmp_path, batches_done=4)
    with caplog.at_level(logging.WARNING):
        resumed = resumed_job(tmp_path, before.replace(resume="auto", batch_size=64))
    assert (resumed.epoch, resumed.batches_done) == (2, 0)  # its 4 batches of 32 are not 4 batches of 64
    assert "part-way through epoch 3 with --batch-size 32: that epoch restarts from its beginning with 64" in caplog.text
    assert optimizer_settings(resumed) == optimizer_settings(straight_run_at(before.replace(batch_size=64), 10))


def test_a_changed_seed_is_refused_in_one_line(tmp_path):
    from mpiddp.errors import AgreedError

    before = first_job(tmp_path)
    with pytest.raises(AgreedError, match=r"cannot continue under: --seed 0 -> 1\. Resume with the snapshot's settings"):
        resumed_job(tmp_path, before.replace(resume="auto", seed=1))


def test_every_setting_is_run_local_refused_or_applied_on_resume():
    """A new flag must be placed: it may differ freely, it is refused, or a resume applies it (tested above, or
    taken from this job's flags when the job is built: data, model wrapping, communication, determinism)."""
    from mpiddp.trainer.snapshot import INCOMPATIBLE_SETTINGS, RUN_LOCAL_SETTINGS

    applied_to_optimizer = {"lr", "momentum", "weight_decay", "epochs", "warmup_epochs", "schedule", "lr_step_epochs",
                            "lr_gamma", "batch_size", "grad_accum", "global_batch"}  # global_batch: as the other two
    built_from_flags = {"image_size", "steps_per_epoch", "grad_compression", "grad_transport", "powersgd_rank", "powersgd_warmup_steps",
                        "bucket_cap_mb", "static_graph", "channels_last", "compile", "deterministic"}
    fields = {f.name for f, _ in flag_fields(Config)}
    assert fields == RUN_LOCAL_SETTINGS | INCOMPATIBLE_SETTINGS | applied_to_optimizer | built_from_flags


def test_a_snapshot_stopped_after_an_epochs_last_batch_resumes_at_the_next_epoch(tmp_path):
    before = first_job(tmp_path, batches_done=BATCHES_AT_32)  # written so by an older mpiddp: 10 of 10 batches
    resumed = resumed_job(tmp_path, before.replace(resume="auto"))
    assert (resumed.epoch, resumed.batches_done, resumed.step) == (3, 0, 30)


def test_a_changed_powersgd_rank_keeps_the_error_feedback_and_restarts_the_warm_start(tmp_path):
    dist = solo_dist()
    before = Config.of(device="cpu", grad_compression="powersgd", powersgd_rank=2, powersgd_warmup_steps=2, bucket_cap_mb=0.01)

    def train(state, count):
        for _ in range(count):
            torch.nn.functional.cross_entropy(state.model(torch.randn(8, 1, 8, 8)), torch.randint(0, 10, (8,))).backward()
            state.optimizer.step()
            state.optimizer.zero_grad()
            state.step += 1

    state = build_state(before, dist, 10, 1, batches_per_epoch=5)
    train(state, 4)
    taken = Snapshot.capture(state, dist, before.data.model_name, before.to_dict(), None)
    assert taken.side_ranks == 1 and taken.own_side["q"] and taken.own_side["error"]
    taken.take_own_side(0, taken.own_side)  # as checkpoint.restore does with this rank's side file
    fresh = build_state(before.replace(powersgd_rank=1), dist, 10, 1, batches_per_epoch=5)
    taken.restore_into(fresh, dist, seed=0, batch_size=32)
    assert fresh.gradient_hook._pending_q == {} and fresh.gradient_hook._pending_error
    train(fresh, 2)  # rank-1 matrices from here on; the old rank-2 ones would not fit
    assert all(torch.isfinite(p).all() for p in fresh.unwrapped.parameters())


def test_a_changed_setting_without_effect_says_so(tmp_path):
    taken = Snapshot.capture(trained_state(1), solo_dist(), "digits_cnn",
                             Config.of(optimizer="adamw", momentum=0.9, lr_gamma=0.1).to_dict(), None)
    changes = taken.check_settings(Config.of(optimizer="adamw", momentum=0.5, lr_gamma=0.5, schedule="step").to_dict())
    assert changes == ["--lr-gamma changed from 0.1 to 0.5",
                       "--momentum changed from 0.9 to 0.5 (no effect: it acts only with --optimizer sgd)",
                       "--schedule changed from 'cosine' to 'step'"]


def test_resume_sends_each_rank_only_its_own_state():
    """What rank 0 broadcasts at resume holds no rank's RNG or PowerSGD state; each rank gets its own by scatter."""
    from mpiddp.trainer.snapshot import Snapshot

    feedback = [{"error": {"w": torch.full((1000,), float(rank))}} for rank in range(3)]
    rngs = [{"torch": torch.tensor([rank])} for rank in range(3)]
    saved = Snapshot(arch="digits_cnn", model={}, optimizer={}, scheduler={}, epoch=1, step=10, rng=rngs,
                     world_size=3, communication=feedback)
    shared, parts = saved.split_per_rank(world_size=4)  # resumed on one rank more
    assert shared.rng == [None] * 3 and shared.communication == [None] * 3
    assert saved.rng is rngs and saved.communication is feedback  # the loaded snapshot itself is untouched
    assert [part[1] for part in parts] == [*feedback, None] and parts[3] == (None, None)
    mine = dataclasses.replace(shared, rng=list(shared.rng), communication=list(shared.communication))
    mine.take_own_part(1, parts[1])
    assert mine.rng == [None, rngs[1], None] and mine.communication == [None, feedback[1], None]
    beyond = dataclasses.replace(shared, rng=list(shared.rng), communication=list(shared.communication))
    beyond.take_own_part(3, parts[3])  # a rank the saved job did not have
    assert beyond.rng == [None] * 3


def powersgd_state(steps=4):
    cfg = Config.of(device="cpu", grad_compression="powersgd", powersgd_rank=2, powersgd_warmup_steps=2, bucket_cap_mb=0.01)
    state = build_state(cfg, solo_dist(), 10, 1, batches_per_epoch=5)
    for _ in range(steps):
        torch.nn.functional.cross_entropy(state.model(torch.randn(8, 1, 8, 8)), torch.randint(0, 10, (8,))).backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.step += 1
    return cfg, state


def test_powersgd_state_is_saved_per_rank_beside_the_snapshot_and_read_back_by_its_rank(tmp_path):
    cfg, state = powersgd_state()
    dist = solo_dist()
    taken = Snapshot.capture(state, dist, cfg.data.model_name, cfg.to_dict(), None)
    path = checkpoint.save(tmp_path, taken, dist, keep_last=1)
    payload = torch.load(path, weights_only=True)
    # Nothing of any rank's PowerSGD state is in the snapshot file (nor gathered to rank 0): each rank's own file.
    assert payload["communication"] == [] and payload["side_ranks"] == 1 and "own_side" not in payload
    own = torch.load(checkpoint.side_path(path, 0), weights_only=True)
    assert own["error"] and all(torch.equal(own["error"][k], taken.own_side["error"][k]) for k in own["error"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage", path.name, f"{path.name}.rank00000"]

    _, restored = checkpoint.restore("auto", tmp_path, cfg.data.model_name, dist)
    assert list(restored.communication[0]["error"]) == list(own["error"])
    fresh = build_state(cfg, dist, 10, 1, batches_per_epoch=5)
    restored.restore_into(fresh, dist, seed=0, batch_size=32)
    assert all(torch.equal(fresh.gradient_hook._pending_error[k], own["error"][k]) for k in own["error"])

    state.epoch += 1  # the next snapshot rotates this one away, its side file with it
    checkpoint.save(tmp_path, Snapshot.capture(state, dist, cfg.data.model_name, cfg.to_dict(), None), dist, keep_last=1,
                    parent=path)
    assert not path.exists() and not checkpoint.side_path(path, 0).exists()


def test_a_rank_beyond_the_saved_side_files_starts_powersgd_from_zero():
    saved = Snapshot(arch="digits_cnn", model={}, optimizer={}, scheduler={}, epoch=1, step=10, rng=[], world_size=2,
                     side_ranks=2)
    saved.take_own_side(3, None)  # a rank the saved job did not have: as with the older in-file list
    assert saved.communication == [None, None]
    saved.take_own_side(1, {"error": {}})
    assert saved.communication == [None, {"error": {}}]
