"""Logging prefix, and when and how rank 0's progress bar draws."""

import io
import logging

from mpiddp.collective import solo_topology
from mpiddp.log import NullProgress, ProgressBar, make_progress, progress_wanted, setup_logging


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
