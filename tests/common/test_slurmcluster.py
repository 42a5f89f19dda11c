"""When the Slurm tier may skip (tests/slurmcluster.py): only where a test Slurm cannot start, never where it should."""

import shutil

import pytest

import slurmcluster


@pytest.mark.parametrize("root, installed, ci, skips", [
    (False, False, "true", True),  # impossible: no root, no Slurm
    (False, True, "", True),  # its daemons need root
    (True, False, "", True),  # a developer's machine without Slurm
    (True, False, "true", False),  # CI installs it (.ci/run): missing there is a failure
    (True, True, "", False),  # installed: it must start
])
def test_the_slurm_tier_skips_only_where_it_cannot_start(monkeypatch, root, installed, ci, skips):
    monkeypatch.setattr(slurmcluster.os, "geteuid", lambda: 0 if root else 1000)
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/sbin/{tool}" if installed else None)
    reason = slurmcluster.impossible_reason({"CI": ci})
    assert (reason is not None) == skips, reason


def test_where_it_should_start_what_is_missing_is_named(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "srun" else f"/usr/bin/{tool}")
    assert "srun missing" in slurmcluster.missing_parts()
