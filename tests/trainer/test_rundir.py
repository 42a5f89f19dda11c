"""The run directory in-process: named, created once by rank 0, unwritable places refused in one line."""

import time

import pytest

from mpiddp.errors import AgreedError
from mpiddp.job.collective import solo_dist
from mpiddp.trainer.rundir import prepare_run_dir


def test_default_run_dirs_never_collide(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261122-101010")
    first = prepare_run_dir(None, str(tmp_path / "runs"), solo_dist())
    second = prepare_run_dir(None, str(tmp_path / "runs"), solo_dist())
    assert (first.name, second.name) == ("20261122-101010", "20261122-101010-1")
    assert first.is_dir() and second.is_dir() and first.is_absolute()


def test_a_given_run_dir_is_reused(tmp_path):
    (tmp_path / "mine").mkdir()
    assert prepare_run_dir(str(tmp_path / "mine"), "ignored", solo_dist()) == tmp_path / "mine"


def test_an_unwritable_run_dir_is_one_agreed_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(AgreedError, match="cannot write to the run directory .*: choose a writable --run-dir"):
        prepare_run_dir(str(tmp_path / "file" / "run"), "runs", solo_dist())


def test_written_files_follow_the_umask_not_mkstemps_0600(tmp_path):
    import os

    from mpiddp.trainer.rundir import UMASK, write_json_atomic

    write_json_atomic(tmp_path / "summary.json", {"a": 1})
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o666 & ~UMASK
    assert UMASK == (lambda m: (os.umask(m), m)[1])(os.umask(0o022))  # what the process really has


@pytest.mark.parametrize("restarted_by,who", [("the scheduler", "the scheduler requeued this job"),
                                               ("launch", "launch relaunched this job")])
def test_a_restarted_job_resumes_and_says_who_restarted_it(caplog, restarted_by, who):
    """Slurm's requeue and launch's relaunch both resume from the newest snapshot; the line names which restarted
    the job (from the counts each keeps: job.topology.launcher_restarts), not the scheduler for both."""
    import dataclasses
    import logging

    from mpiddp.trainer.config import CheckpointSettings
    from mpiddp.trainer.run import resume_mode

    dist = solo_dist()
    dist = dataclasses.replace(dist, topology=dataclasses.replace(dist.topology, restarts=2, restarted_by=restarted_by))
    with caplog.at_level(logging.INFO):
        assert resume_mode(CheckpointSettings(), dist) == "auto"
    assert f"{who} (restart 2): resuming from the newest snapshot" in caplog.text
