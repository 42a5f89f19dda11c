"""Logging prefix, and when and how rank 0's progress bar draws."""

import io
import logging

from mpiddp.job.collective import solo_topology
from mpiddp.job.log import NullProgress, ProgressBar, make_progress, progress_wanted, setup_logging


def test_progress_bar_draws_count_rate_and_postfix():
    out = io.StringIO()
    bar = ProgressBar(4, "epoch 1/2", stream=out, min_interval=0)
    bar.update(1)
    bar.update(1, postfix="loss 0.5000")
    bar.close()
    frames = out.getvalue().split("\r")
    assert frames[-1].startswith("epoch 1/2 |############............| 2/4 ")
    assert "loss 0.5000" in frames[-1] and out.getvalue().endswith("\n")


def test_progress_is_off_in_ci_and_off_the_terminal(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert progress_wanted("auto") is False
    assert progress_wanted("on") is True and progress_wanted("off") is False
    assert isinstance(make_progress(False, 10, "x"), NullProgress)


def test_log_lines_name_the_rank_and_host(capsys):
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging(solo_topology("nodea"), "info")
        logging.getLogger("mpiddp.test").info("hello")
        assert "[mpiddp r0/1 nodea] INFO hello" in capsys.readouterr().err
    finally:
        root.handlers[:], root.level = handlers, level


def fake_proc(tmp_path, chain):
    """A /proc with `chain` = [(pid, name, parent, stdout target)], the first entry being our parent."""
    for pid, name, parent, stdout in chain:
        folder = tmp_path / str(pid)
        (folder / "fd").mkdir(parents=True)
        (folder / "stat").write_text(f"{pid} ({name}) S {parent} 1 1 0 -1\n")
        (folder / "fd" / "1").symlink_to(stdout)
    return tmp_path


def test_the_bar_follows_mpiruns_output_not_the_ranks_pty(tmp_path, monkeypatch):
    import os

    from mpiddp.job.log import launcher_output_is_terminal

    monkeypatch.setattr(os, "getppid", lambda: 100)
    to_file = fake_proc(tmp_path / "a", [(100, "prterun", 50, "/tmp/job.log"), (50, "bash", 1, "/dev/pts/0")])
    assert launcher_output_is_terminal(to_file) is False
    to_terminal = fake_proc(tmp_path / "b", [(100, "prterun", 50, "/dev/pts/3"), (50, "bash", 1, "/dev/pts/3")])
    assert launcher_output_is_terminal(to_terminal) is True
    no_launcher = fake_proc(tmp_path / "c", [(100, "python", 1, "/tmp/x")])
    assert launcher_output_is_terminal(no_launcher) is True
