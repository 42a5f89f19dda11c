"""The hot spares of a job whose loop runs under mpiddp.Optimizer (never grows back) are released as the optimizer is
built, once, with one line on rank 0; inside run_recoverable, or without in-job recovery, nothing changes (the
end-to-end test: tests/script/test_step_spares_e2e.py)."""

import logging
from types import SimpleNamespace

import pytest

from mpiddp.elastic import api
from mpiddp.elastic.grow import GrowBack
from mpiddp.job.spares import SpareWorld


@pytest.fixture
def released(monkeypatch):
    """The job's hot spares (one waiting on hostd) and every word to leave sent them."""
    words: list[str] = []
    spares = SpareWorld(world=None, everyone=None, waiting=[3], hosts=["hostd"])  # type: ignore[arg-type]
    monkeypatch.setattr(api, "spare_world", lambda: spares)
    monkeypatch.setattr(api, "release_spares", lambda why="": words.append(why) or spares.waiting.clear())
    return words


def recovering_manager() -> api.Manager:
    manager = api.Manager()
    grower = GrowBack([("hostd", 1)])
    grower.hot = True
    manager.recovery = SimpleNamespace(dists=[SimpleNamespace(is_main=True)], grower=grower)  # type: ignore[assignment]
    return manager


def test_an_optimizer_built_outside_run_recoverable_releases_the_spares_once_saying_why(released, caplog):
    manager = recovering_manager()
    with caplog.at_level(logging.WARNING, logger="mpiddp"):
        manager.release_spares_of_step_loop()
        manager.release_spares_of_step_loop()  # a second optimizer (a GAN's): nothing waits any more
    assert len(released) == 1 and "released at start-up" in released[0]
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith("hot spares released at start-up") and "the 1 hot spare on hostd ends now" in line
    assert "mpiddp.run_recoverable" in line
    assert not manager.recovery.grower.offered  # the first loss does not say it again, nor tries to grow


def test_inside_run_recoverable_or_without_recovery_the_spares_wait(released, caplog):
    manager = recovering_manager()
    manager.running = 1  # run_recoverable's training function builds the optimizer: it may grow back
    manager.release_spares_of_step_loop()
    without = api.Manager()  # no in-job recovery here (no ULFM): a spare could never be used, nor end early
    without.release_spares_of_step_loop()
    assert released == [] and not caplog.records and manager.recovery.grower.offered


def test_a_loop_that_declared_its_position_keeps_its_spares(released, caplog):
    manager = recovering_manager()
    manager.keep({"iter_num": 0}, ("iter_num",))  # mpiddp.keep before the loop: a new rank can enter it
    manager.release_spares_of_step_loop()
    assert released == [] and not caplog.records and manager.recovery.grower.offered


def test_spare_hosts_to_spawn_onto_are_given_up_with_one_line_too(monkeypatch, caplog):
    monkeypatch.setattr(api, "spare_world", lambda: None)  # MPIDDP_SPARE_HOSTS: no hot spare waits
    manager = recovering_manager()
    manager.recovery.grower.hot = False
    with caplog.at_level(logging.WARNING, logger="mpiddp"):
        manager.release_spares_of_step_loop()
    (line,) = [record.getMessage() for record in caplog.records]
    assert line.startswith("not growing back: this loop") and "the spare hosts are not used" in line
    assert not manager.recovery.grower.offered
