"""Snapshots: atomic collective saves, exact resume, resharding on a new world size, and clear load errors."""

import dataclasses
import hashlib
import math
import os

import pytest
import torch

from mpiddp.errors import AgreedError, UserError
from mpiddp.job.collective import solo_dist
from mpiddp.trainer import checkpoint
from mpiddp.trainer.snapshot import Snapshot, rng_state

FAST = ("--no-progress", "--wandb", "disabled")


@pytest.fixture
def solo():
    return solo_dist()


def snapshot(value, arch="digits_cnn", batches_done=0, mark=None):
    """`mark` tells apart two snapshots of the same progress (the one a rollback overwrote)."""
    return Snapshot(arch=arch, model={"w": torch.full((3,), float(value if mark is None else mark))}, optimizer={},
                    scheduler={}, epoch=value, step=value * 10, rng=[rng_state(torch.device("cpu"))], world_size=1,
                    batches_done=batches_done)


def names(directory):
    return [p.name for p in checkpoint.list_snapshots(directory)]


def job(directory, solo, snapshots, keep_last, parent=None):
    """One job's saves as main.run makes them: the first continues `parent` (what the job resumed from, None for a
    fresh run), each later one the snapshot saved before it. Returns the last path."""
    for taken in snapshots:
        parent = checkpoint.save(directory, taken, solo, keep_last, parent)
    return parent


def name(epoch, batches_done=0, revision=0):
    return checkpoint.snapshot_name(epoch, batches_done, revision)


def rev(epoch, batches_done=0):
    """The name a rollback's snapshot gets where the abandoned one of the same position is still on disk."""
    return checkpoint.snapshot_name(epoch, batches_done, 1)


def test_save_rotates_and_points_latest(tmp_path, solo):
    job(tmp_path, solo, [snapshot(epoch) for epoch in range(1, 6)], keep_last=2)
    assert [p.name for p in checkpoint.list_snapshots(tmp_path)] == ["snapshot-epoch0004.pt", "snapshot-epoch0005.pt"]
    assert (tmp_path / "latest").read_text().strip() == "snapshot-epoch0005.pt"
    path, loaded = checkpoint.resolve("auto", tmp_path)
    assert loaded.epoch == 5 and loaded.world_size == 1 and len(loaded.rng) == 1


def test_a_stopped_snapshot_rotates_in_training_order(tmp_path, solo):
    job(tmp_path, solo, [snapshot(e, batches_done=b) for e, b in ((1, 0), (1, 7), (2, 0), (3, 0))], keep_last=2)
    assert names(tmp_path) == ["snapshot-epoch0002.pt", "snapshot-epoch0003.pt"]
    assert checkpoint.read_lineage(tmp_path) == names(tmp_path)


def test_a_save_after_a_rollback_keeps_itself_and_rotates_only_its_lineage(tmp_path, solo):
    job(tmp_path, solo, [snapshot(epoch) for epoch in range(1, 6)], keep_last=5)
    # A job resumed from epoch 2 (--resume PATH) saves its epoch 3 with --keep-last 2: by name, the new epoch 3 was
    # the oldest but two and went, leaving `latest` naming a missing file.
    third = checkpoint.save(tmp_path, snapshot(3, mark=33), solo, 2, tmp_path / name(2))
    assert (tmp_path / "latest").read_text().strip() == "snapshot-epoch0003-r1.pt"
    assert names(tmp_path) == [name(2), name(3), rev(3),  # the lineage's newest 2, beside the abandoned epoch 3
                               name(4), name(5)]  # the abandoned future, untouched
    assert checkpoint.read_lineage(tmp_path) == [name(2), rev(3)]
    path, found = checkpoint.resolve("auto", tmp_path)
    assert path.name == rev(3) and found.model["w"][0] == 33
    # The new lineage goes on beside the abandoned names; rotation follows it.
    checkpoint.save(tmp_path, snapshot(4, mark=44), solo, 2, third)
    assert names(tmp_path) == [name(3), rev(3), name(4), rev(4), name(5)]
    assert checkpoint.resolve("auto", tmp_path)[1].model["w"][0] == 44
    assert [checkpoint.load(tmp_path / name(e)).model["w"][0] for e in (3, 4)] == [3, 4]


def test_a_lowered_keep_last_never_deletes_the_new_snapshot(tmp_path, solo):
    job(tmp_path, solo, [snapshot(epoch) for epoch in range(1, 6)], keep_last=5)
    second = checkpoint.save(tmp_path, snapshot(2, mark=22), solo, 5, tmp_path / name(1))  # a rollback to epoch 1
    checkpoint.save(tmp_path, snapshot(3, mark=33), solo, 1, second)  # then, in a later job, --keep-last 1
    assert (tmp_path / rev(3)).is_file() and not (tmp_path / rev(2)).exists()
    assert (tmp_path / name(2)).is_file()  # abandoned by the rollback, never rotated
    assert checkpoint.read_lineage(tmp_path) == [rev(3)]
    assert checkpoint.resolve("auto", tmp_path)[1].model["w"][0] == 33


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_auto_after_a_rollback_never_picks_the_abandoned_future(tmp_path, solo, damage):
    job(tmp_path, solo, [snapshot(epoch) for epoch in range(1, 6)], keep_last=5)
    checkpoint.save(tmp_path, snapshot(3, mark=33), solo, 5, tmp_path / name(2))  # resumed from epoch 2
    head = tmp_path / rev(3)
    if damage == "missing":
        head.unlink()
    else:
        head.write_bytes(head.read_bytes()[:100])
    path, found = checkpoint.resolve("auto", tmp_path)  # by name it was epoch 5, which this lineage never had
    assert path.name == "snapshot-epoch0002.pt" and found.epoch == 2


def test_a_directory_without_a_lineage_file_rotates_up_to_latest(tmp_path, solo):
    job(tmp_path, solo, [snapshot(epoch) for epoch in range(1, 4)], keep_last=5)
    (tmp_path / "lineage").unlink()  # as an older mpiddp left it
    checkpoint.save(tmp_path, snapshot(4), solo, 2, tmp_path / name(3))
    assert names(tmp_path) == ["snapshot-epoch0003.pt", "snapshot-epoch0004.pt"]


def test_an_explicit_resume_of_an_abandoned_snapshot_continues_it_not_the_rollback(tmp_path, solo):
    job(tmp_path, solo, [snapshot(epoch) for epoch in range(1, 6)], keep_last=5)
    job(tmp_path, solo, [snapshot(3, mark=33)], keep_last=5, parent=tmp_path / name(2))  # a rollback to epoch 2
    # Then --resume snapshot-epoch0005.pt: by name, the new epoch 6 continued the rollback's epoch 3, whose
    # lineage rotation then deleted epochs 1 and 2 and kept the abandoned 3.
    sixth = job(tmp_path, solo, [snapshot(6)], keep_last=2, parent=tmp_path / name(5))
    assert checkpoint.read_lineage(tmp_path) == [name(5), name(6)]
    assert names(tmp_path) == [name(1), name(2), name(3), rev(3), name(4), name(5), name(6)]  # nothing rotated
    job(tmp_path, solo, [snapshot(7)], keep_last=2, parent=sixth)
    assert checkpoint.read_lineage(tmp_path) == [name(6), name(7)]
    # epoch 5, its real parent, rotated away
    assert names(tmp_path) == [name(1), name(2), name(3), rev(3), name(4), name(6), name(7)]
    assert checkpoint.load(tmp_path / rev(3)).model["w"][0] == 33  # the abandoned rollback, untouched
    assert checkpoint.load(tmp_path / name(3)).model["w"][0] == 3  # and the future it abandoned, too
    assert checkpoint.resolve("auto", tmp_path)[1].epoch == 7


def test_a_snapshot_resumed_from_another_directory_starts_a_new_lineage(tmp_path, solo):
    elsewhere, here = tmp_path / "elsewhere", tmp_path / "here"
    job(elsewhere, solo, [snapshot(epoch) for epoch in range(1, 4)], keep_last=5)
    job(here, solo, [snapshot(epoch, mark=10 + epoch) for epoch in range(1, 6)], keep_last=5)  # an earlier run's
    # --resume elsewhere/snapshot-epoch0003.pt --checkpoint-dir here: by name, the new epoch 4 continued here's
    # epochs 1-3 (another run's), and rotation deleted them.
    job(here, solo, [snapshot(4), snapshot(5), snapshot(6)], keep_last=2, parent=elsewhere / name(3))
    assert checkpoint.read_lineage(here) == [rev(5), name(6)]
    # here's epoch 3 is not the parent, only its name; here's 4 and 5 are another run's, never overwritten
    assert names(here) == [name(1), name(2), name(3), name(4), name(5), rev(5), name(6)]
    assert [checkpoint.load(here / name(e)).model["w"][0] for e in (1, 2, 3, 4, 5)] == [11, 12, 13, 14, 15]
    assert names(elsewhere) == [name(e) for e in range(1, 4)]
    assert checkpoint.resolve("auto", here)[1].model["w"][0] == 6


def test_a_fresh_runs_lineage_is_its_own_saves_only(tmp_path, solo):
    # An earlier attempt left a truncated stop snapshot and nothing loadable, so --resume auto starts from scratch.
    job(tmp_path, solo, [snapshot(0, batches_done=5)], keep_last=3)
    stale = tmp_path / name(0, 5)
    stale.write_bytes(stale.read_bytes()[:100])
    assert checkpoint.resolve("auto", tmp_path) is None
    # By name, the fresh run's first snapshot continued the broken stop snapshot it never resumed from.
    job(tmp_path, solo, [snapshot(1)], keep_last=3)
    assert checkpoint.read_lineage(tmp_path) == [name(1)]
    job(tmp_path, solo, [snapshot(2), snapshot(3), snapshot(4)], keep_last=3, parent=tmp_path / name(1))
    assert checkpoint.read_lineage(tmp_path) == [name(2), name(3), name(4)]
    assert names(tmp_path) == [name(0, 5), name(2), name(3), name(4)]
    assert checkpoint.resolve("auto", tmp_path)[1].epoch == 4


def test_a_rollback_then_several_saves_rotate_only_the_rollbacks_lineage(tmp_path, solo):
    # A job stopped 4 batches into epoch 3 and its resume went on to epoch 4.
    job(tmp_path, solo, [snapshot(e, batches_done=b) for e, b in ((1, 0), (2, 0), (2, 4), (3, 0), (4, 0))], 5)
    # --resume snapshot-epoch0002.pt with --keep-last 2, stopped 7 batches in: by name, the abandoned stop at
    # batch 4 was its past, and the real parent, epoch 2, was rotated away.
    stop = job(tmp_path, solo, [snapshot(2, batches_done=7)], keep_last=2, parent=tmp_path / name(2))
    assert checkpoint.read_lineage(tmp_path) == [name(2), name(2, 7)]
    assert names(tmp_path) == [name(2), name(2, 4), name(2, 7), name(3), name(4)]
    last = job(tmp_path, solo, [snapshot(e, mark=10 * e) for e in (3, 4, 5)], keep_last=2, parent=stop)
    assert checkpoint.read_lineage(tmp_path) == [rev(4), name(5)]
    # the abandoned stop snapshot and epochs 3 and 4, never rotated nor overwritten
    assert names(tmp_path) == [name(2, 4), name(3), name(4), rev(4), name(5)]
    path, found = checkpoint.resolve("auto", tmp_path)
    assert path == last and found.model["w"][0] == 50


def md5s(directory):
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in checkpoint.list_snapshots(directory)}


def test_a_rollback_never_overwrites_the_abandoned_snapshots(tmp_path, solo):
    job(tmp_path, solo, [snapshot(epoch) for epoch in range(1, 4)], keep_last=5)
    before = md5s(tmp_path)
    # --resume snapshot-epoch0001.pt, then epochs 2 and 3 again (another data order, other weights)
    job(tmp_path, solo, [snapshot(2, mark=22), snapshot(3, mark=33)], keep_last=5, parent=tmp_path / name(1))
    after = md5s(tmp_path)
    assert {n: after[n] for n in before} == before  # "left on disk", as they were
    assert set(after) - set(before) == {rev(2), rev(3)}
    assert checkpoint.read_lineage(tmp_path) == [name(1), rev(2), rev(3)]
    assert checkpoint.resolve("auto", tmp_path)[1].model["w"][0] == 33
    job(tmp_path, solo, [snapshot(2, mark=222)], keep_last=5, parent=tmp_path / name(1))  # and once more
    assert checkpoint.latest_name(tmp_path) == name(2, 0, 2) and md5s(tmp_path)[rev(2)] == after[rev(2)]


def test_a_relaunch_resumes_what_its_launch_saved_not_the_rollback_path(tmp_path, solo):
    job(tmp_path, solo, [snapshot(epoch) for epoch in range(1, 4)], keep_last=5)  # an earlier launch's
    rollback = tmp_path / name(1)
    # attempt 0 of launch L resumed the user's --resume .../epoch0001 and failed before saving: its relaunch
    # takes the user's path again (`latest` names the abandoned epoch 3, another launch's)
    assert checkpoint.resolve_relaunch(str(rollback), tmp_path, "L")[0] == rollback
    saved = dataclasses.replace(snapshot(2, mark=22), launch_id="L")
    job(tmp_path, solo, [saved], keep_last=5, parent=rollback)  # attempt 0 saved its epoch 2, then failed
    path, found = checkpoint.resolve_relaunch(str(rollback), tmp_path, "L")
    assert path.name == rev(2) and found.model["w"][0] == 22 and found.launch_id == "L"
    assert checkpoint.resolve_relaunch(str(rollback), tmp_path, "another")[0] == rollback  # a new launch: the path
    assert checkpoint.resolve_relaunch(str(rollback), tmp_path, "")[0] == rollback  # not under launch


def test_latest_moves_only_after_every_rank_heard_the_save(tmp_path, solo, monkeypatch):
    checkpoint.save(tmp_path, snapshot(1), solo, keep_last=3)

    def peer_died():  # what a barrier does when another rank is gone: the job ends here
        raise RuntimeError("rank 1 is gone")

    monkeypatch.setattr(solo.transport, "barrier", peer_died)
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        checkpoint.save(tmp_path, snapshot(2), solo, keep_last=3)
    assert (tmp_path / "latest").read_text().strip() == "snapshot-epoch0001.pt"
    assert checkpoint.read_lineage(tmp_path) == ["snapshot-epoch0001.pt"]
    assert checkpoint.resolve("auto", tmp_path)[1].epoch == 1


@pytest.mark.parametrize("where", ["barrier", "bcast"])
def test_a_save_given_up_when_a_peer_died_leaves_no_file_and_is_saved_again_under_its_name(tmp_path, solo, monkeypatch,
                                                                                          where):
    """In-job recovery gives up a save that lost a rank after rank 0 wrote the file (noticed in the barrier after
    it, or in the broadcast of its name): rank 0 removes that file (`latest` never named it), and the save done
    again by the survivors takes the same name, in the lineage."""
    checkpoint.save(tmp_path, snapshot(1), solo, keep_last=3)

    def peer_died(*args):
        raise RuntimeError("rank 1 is gone")

    with monkeypatch.context() as patched:
        patched.setattr(solo.transport, where, peer_died)
        with pytest.raises(RuntimeError, match="rank 1 is gone"):
            checkpoint.save(tmp_path, snapshot(2), solo, keep_last=3, parent=tmp_path / name(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage", name(1)]
    assert checkpoint.save(tmp_path, snapshot(2), solo, keep_last=3, parent=tmp_path / name(1)).name == name(2)
    assert checkpoint.read_lineage(tmp_path) == [name(1), name(2)]
    assert checkpoint.resolve("auto", tmp_path)[1].epoch == 2


def test_a_rank_0_killed_while_it_wrote_leaves_a_temporary_file_that_is_never_a_snapshot_and_goes(tmp_path, solo):
    """A rank 0 SIGKILLed in the middle of a snapshot's write leaves write_atomic's temporary file (no clean-up
    runs): resume never takes it, and the next save (the survivors', or the relaunch's) removes it."""
    checkpoint.save(tmp_path, snapshot(1), solo, keep_last=3)
    partial = tmp_path / f".{name(2)}.x1y2z3.tmp"
    partial.write_bytes((tmp_path / name(1)).read_bytes()[:100])  # half a snapshot
    assert names(tmp_path) == [name(1)] and checkpoint.resolve("auto", tmp_path)[1].epoch == 1
    (tmp_path / "latest").unlink()  # a directory without `latest` too (the newest by name)
    assert checkpoint.resolve("auto", tmp_path)[1].epoch == 1
    checkpoint.save(tmp_path, snapshot(2), solo, keep_last=3, parent=tmp_path / name(1))
    assert not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage", name(1), name(2)]


def test_interrupted_save_keeps_previous_snapshot(tmp_path, solo, monkeypatch):
    checkpoint.save(tmp_path, snapshot(1), solo, keep_last=3)

    def disk_full(fd):
        raise OSError(28, "No space left on device")  # where a full disk often surfaces: flushing the data

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(AgreedError, match="No space left on device.*snapshot-epoch0001.pt is intact"):
        checkpoint.save(tmp_path, snapshot(2), solo, keep_last=3)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "lineage", "snapshot-epoch0001.pt"]
    assert checkpoint.resolve("auto", tmp_path)[1].epoch == 1


def test_auto_skips_a_truncated_newest_snapshot(tmp_path, solo):
    job(tmp_path, solo, [snapshot(1), snapshot(2)], keep_last=3)
    newest = tmp_path / "snapshot-epoch0002.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    assert checkpoint.resolve("auto", tmp_path)[1].epoch == 1
    with pytest.raises(UserError, match="corrupt, truncated"):
        checkpoint.resolve(str(newest), tmp_path)


def test_restore_refuses_another_model_on_every_rank(tmp_path, solo):
    checkpoint.save(tmp_path, snapshot(1), solo, keep_last=3)
    with pytest.raises(AgreedError, match="holds a 'digits_cnn' model but this run builds 'resnet18'"):
        checkpoint.restore("auto", tmp_path, "resnet18", solo)
    path, found = checkpoint.restore("auto", tmp_path, "digits_cnn", solo)
    assert path.name == "snapshot-epoch0001.pt" and found.step == 10
    assert checkpoint.restore("auto", tmp_path / "empty", "digits_cnn", solo) is None


def test_final_weights_failure_is_agreed(tmp_path, solo):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(AgreedError, match="writing the final weights to .* failed"):
        checkpoint.save_weights(blocker / "model.pth", {"w": torch.zeros(1)}, solo)
    checkpoint.save_weights(tmp_path / "out" / "model.pth", {"w": torch.zeros(1)}, solo)
    assert torch.load(tmp_path / "out" / "model.pth", weights_only=True)["w"].shape == (1,)


def test_a_snapshot_that_would_run_code_is_refused(tmp_path):
    class Sneaky:
        def __reduce__(self):
            return (print, ("this must never run",))

    path = tmp_path / "evil.pt"
    torch.save({"format": 1, "x": Sneaky()}, path)
    with pytest.raises(UserError, match="corrupt, truncated or not an mpiddp snapshot"):
        checkpoint.load(path)


def test_a_plain_state_dict_is_not_a_snapshot(tmp_path):
    path = tmp_path / "weights.pth"
    torch.save({"fc.weight": torch.zeros(2)}, path)
    with pytest.raises(UserError, match="not an mpiddp snapshot"):
        checkpoint.load(path)


def steps_per_epoch(world_size, batch_size, num_train=1438):
    return math.ceil(num_train / world_size) // batch_size


@pytest.mark.mpi
@pytest.mark.floor  # also run against the oldest supported torch in CI
@pytest.mark.parametrize("communication", [
    (),
    # PowerSGD's per-rank error feedback and warm start come back too, across DDP's bucket rebuild
    ("--grad-compression", "powersgd", "--powersgd-warmup-steps", "3", "--bucket-cap-mb", "0.01"),
], ids=["allreduce", "powersgd"])
def test_crash_then_resume_equals_straight_run(run_job, tmp_path, communication):
    flags = ("--epochs", "4", "--batch-size", "64", "--deterministic", *FAST, *communication)
    straight = run_job(2, *flags, run_dir=tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-3000:]

    interrupted_dir = tmp_path / "interrupted"
    first_step_of_epoch_3 = 2 * steps_per_epoch(2, 64) + 1
    crashed = run_job(2, *flags, "--inject-fault", f"raise:0:{first_step_of_epoch_3}", run_dir=interrupted_dir)
    assert crashed.returncode != 0
    resumed = run_job(2, *flags, "--resume", run_dir=interrupted_dir)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.summary["resumed_from"].endswith("snapshot-epoch0002.pt")
    assert resumed.summary["epochs"] == 4

    a = torch.load(tmp_path / "straight" / "checkpoints" / "snapshot-epoch0004.pt", weights_only=True)
    b = torch.load(tmp_path / "interrupted" / "checkpoints" / "snapshot-epoch0004.pt", weights_only=True)
    assert a["step"] == b["step"] == 4 * steps_per_epoch(2, 64)
    if not communication:
        for name, tensor in a["model"].items():
            assert torch.equal(tensor, b["model"][name]), name
        assert resumed.summary["train_loss"] == pytest.approx(straight.summary["train_loss"], rel=1e-9)
    else:
        # Equal up to float rounding: DDP's first step after a restart lays the buckets out differently, and
        # the rounding grows over the following steps (measured after 44 steps: under 1e-6 on torch 2.14, 5e-6
        # on 2.4.1). Without the PowerSGD state, weights differ by about 1e-2 (tests/job/test_compression.py).
        # Each rank saved its own PowerSGD state beside each snapshot; the snapshot file holds none of it.
        checkpoints = tmp_path / "interrupted" / "checkpoints"
        assert b["communication"] == [] and b["side_ranks"] == 2
        kept = [p.name for p in checkpoint.list_snapshots(checkpoints)]
        sides = sorted(p.name for p in checkpoints.glob("snapshot-*.pt.rank*"))  # rotated ones went with theirs
        assert sides == sorted(f"{name}.rank{rank:05d}" for name in kept for rank in range(2))
        for rank in range(2):
            own = torch.load(checkpoint.side_path(checkpoints / "snapshot-epoch0004.pt", rank), weights_only=True)
            assert own["error"]
        assert "PowerSGD error feedback starts from zero" not in resumed.output
        for name, tensor in a["model"].items():
            difference = float((tensor - b["model"][name]).abs().max())
            assert difference < 1e-4, (name, difference)
        assert resumed.summary["train_loss"] == pytest.approx(straight.summary["train_loss"], rel=1e-4)


@pytest.mark.mpi
def test_resume_on_another_world_size_reshards_and_continues_wandb(run_job, tmp_path):
    run_dir = tmp_path / "run"
    first = run_job(2, "--epochs", "2", "--no-progress", "--wandb", "offline", run_dir=run_dir)
    assert first.returncode == 0, first.output[-3000:]
    second = run_job(3, "--epochs", "3", "--resume", "--no-progress", "--wandb", "offline", run_dir=run_dir)
    assert second.returncode == 0, second.output[-3000:]
    assert "resuming a 2-rank snapshot on 3 ranks" in second.output
    summary = second.summary
    assert summary["world_size"] == 3 and summary["epochs"] == 3
    assert summary["steps"] == steps_per_epoch(3, 32)  # one epoch in this job, on the 3-way shards
    assert summary["wandb_run_id"] == first.summary["wandb_run_id"]


@pytest.mark.mpi
@pytest.mark.parametrize(
    "setup, flags, message",
    [
        ("none", ("--resume", "{tmp}/nope.pt"), "snapshot {tmp}/nope.pt does not exist"),
        ("truncate", ("--resume", "{snap}"), "is corrupt, truncated or not an mpiddp snapshot"),
        ("none", ("--resume", "{snap}", "--arch", "resnet18"), "holds a 'digits_cnn' model but this run builds 'resnet18'"),
    ],
)
def test_bad_snapshots_are_one_clear_error(run_job, tmp_path, setup, flags, message):
    source = run_job(1, "--epochs", "1", *FAST, run_dir=tmp_path / "src")
    assert source.returncode == 0, source.output[-3000:]
    snap = tmp_path / "src" / "checkpoints" / "snapshot-epoch0001.pt"
    original = snap.read_bytes()
    if setup == "truncate":
        snap.write_bytes(original[: len(original) // 2])
    fill = {"tmp": str(tmp_path), "snap": str(snap)}
    job = run_job(2, "--epochs", "2", *(f.format(**fill) for f in flags), *FAST, timeout=90)
    assert job.returncode == 2
    assert job.output.count(message.format(**fill)) == 1
    assert "Traceback" not in job.output
    if setup == "none":
        assert snap.read_bytes() == original  # nothing already saved is touched


@pytest.mark.mpi
def test_a_run_dir_with_snapshots_is_never_silently_reused(run_job, tmp_path):
    import json

    from conftest import job_env

    run_dir = tmp_path / "run"
    first = run_job(2, "--epochs", "2", *FAST, run_dir=run_dir)
    assert first.returncode == 0, first.output[-3000:]
    snapshots = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()}
    metrics, summary = (run_dir / "metrics.jsonl").read_text(), (run_dir / "summary.json").read_text()

    again = run_job(2, "--epochs", "2", *FAST, run_dir=run_dir, timeout=90)  # the same command, no --resume
    assert again.returncode == 2
    assert again.output.count("already holds snapshots of an earlier job (newest: snapshot-epoch0002.pt): "
                              "add --resume") == 1
    finished = run_job(2, "--epochs", "2", "--resume", *FAST, run_dir=run_dir, timeout=90)
    assert finished.returncode == 0 and "nothing to do" in finished.output
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").iterdir()} == snapshots
    assert (run_dir / "metrics.jsonl").read_text() == metrics and (run_dir / "summary.json").read_text() == summary

    # A requeued job (same job id, same command, no --resume) continues by itself; --epochs may grow.
    requeued = run_job(2, "--epochs", "3", *FAST, run_dir=run_dir, env=job_env(SLURM_RESTART_COUNT="1"))
    assert requeued.returncode == 0, requeued.output[-3000:]
    assert requeued.summary["resumed_from"].endswith("snapshot-epoch0002.pt") and requeued.summary["epochs"] == 3
    assert "resuming with --epochs changed from 2 to 3" in requeued.output
    assert "learning-rate schedule changed" in requeued.output
    starts = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "start"]
    assert [(s["epoch"], s["resumed_from"] is not None) for s in starts] == [(0, False), (2, True)]


@pytest.mark.mpi
def test_settings_that_cannot_continue_a_snapshot_are_refused(run_job, tmp_path):
    run_dir = tmp_path / "run"
    assert run_job(1, "--epochs", "1", *FAST, run_dir=run_dir).returncode == 0
    changed = run_job(2, "--epochs", "2", "--resume", "--amp", "bf16", "--optimizer", "adamw", *FAST,
                      run_dir=run_dir, timeout=90)
    assert changed.returncode == 2 and "Traceback" not in changed.output
    assert changed.output.count("cannot continue under: --optimizer 'sgd' -> 'adamw', --amp 'off' -> 'bf16'") == 1
    nothing = run_job(2, "--epochs", "1", "--resume", *FAST, run_dir=tmp_path / "empty", timeout=90)
    assert nothing.returncode == 0 and nothing.output.count("--resume: no snapshot in") == 1


@pytest.mark.mpi
def test_a_changed_lr_on_resume_is_the_lr_that_trains(run_job, tmp_path):
    """Issue 19: `--epochs 2`, then `--epochs 4 --lr 0.5 --resume` logged the new lr and trained on 0.05's cosine."""
    from mpiddp.trainer.optim import lr_factor

    run_dir = tmp_path / "run"
    first = run_job(2, "--epochs", "2", *FAST, run_dir=run_dir)
    assert first.returncode == 0, first.output[-3000:]
    steps_per_epoch = next(r["step"] for r in first.metrics if r["kind"] == "epoch" and r["epoch"] == 1)
    resumed = run_job(2, "--epochs", "4", "--lr", "0.5", "--resume", *FAST, run_dir=run_dir)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resuming with --lr changed from 0.05 to 0.5" in resumed.output
    records = resumed.metrics
    start = max(i for i, r in enumerate(records) if r["kind"] == "start")
    later = [r for r in records[start:] if r["kind"] in ("step", "epoch")]
    assert {r["epoch"] for r in later} == {3, 4} and len(later) > 2
    for record in later:  # the lr after the record's step: what the next step trains at
        expected = 0.5 * lr_factor(record["step"], steps_per_epoch=steps_per_epoch, total_steps=4 * steps_per_epoch,
                                   warmup_steps=0, schedule="cosine", lr_step_epochs=30, lr_gamma=0.1)
        assert record["lr"] == pytest.approx(expected, abs=1e-12), record
    epoch_3 = next(r for r in later if r["kind"] == "epoch" and r["epoch"] == 3)
    assert epoch_3["lr"] == pytest.approx(0.5 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))  # 0.0732, not 0.0073
