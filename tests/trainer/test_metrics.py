"""Summary fields, statistics, atomic writes and the eval sharding: no MPI needed."""

import json
import time

import numpy as np
import pytest

from mpiddp.job.topology import RankRecord, build_topology
from mpiddp.trainer.data import EvalShardSampler, digits_split
from mpiddp.trainer.metrics import build_summary, process_start_time
from mpiddp.trainer.rundir import write_json_atomic
from mpiddp.trainer.steptime import Durations, StepDurations, StepTime

REQUIRED = {
    "world_size", "num_hosts", "hosts", "backend", "device", "epochs", "train_loss", "eval_accuracy",
    "images_per_second", "step_time_s", "rank_step_time_s", "time_to_first_step_s", "wall_time_s",
    "mpi_library", "mpi_settings", "torch_version",
}


def test_durations_are_fixed_size_and_their_quantiles_close():
    rng = np.random.default_rng(0)
    values = rng.lognormal(mean=-3, sigma=0.8, size=20_000)
    parts = [Durations(), Durations()]
    for index, value in enumerate(values):
        parts[index % 2].add(float(value))
    merged = Durations.merged(parts)
    assert len(merged.bins) == len(Durations().bins)  # the same 400 integers after 20,000 steps
    assert merged.count == 20_000 and merged.mean == pytest.approx(values.mean())
    assert merged.largest == values.max()
    for fraction, name in ((0.5, "p50"), (0.9, "p90")):
        assert merged.quantile(fraction) == pytest.approx(np.quantile(values, fraction), rel=0.03)
        assert merged.distribution()[name] == merged.quantile(fraction)
    assert Durations().distribution() == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}


def rank_durations(steps: list[float], waits: list[float], computes: list[float]) -> StepDurations:
    durations = StepDurations()
    for step, wait, compute in zip(steps, waits, computes):
        durations.add(StepTime(step, wait, compute, 8))
    return durations


def test_summary_has_every_documented_field_and_right_arithmetic():
    records = [RankRecord(0, "a", 0, 0, 1), RankRecord(1, "b", 1, 0, 1)]
    topo = build_topology(0, records, "Open MPI v5")
    summary = build_summary(
        config={"epochs": 2},
        topo=topo,
        backend="gloo",
        device="cpu",
        epochs=[
            {"epoch": 1, "train_loss": 1.0, "eval_accuracy": 0.5},
            {"epoch": 2, "train_loss": 0.5, "eval_accuracy": 0.9, "eval_loss": 0.3},
        ],
        rank_durations=[rank_durations([0.1, 0.2, 0.3], [0.01, 0.01, 0.01], [0.05, 0.05, 0.05]),
                        rank_durations([0.3, 0.3, 0.3], [0.1, 0.1, 0.1], [0.05, 0.06, 0.07])],
        rank_images_after_warmup=[64, 64],
        rank_seconds_after_warmup=[0.5, 0.8],
        first_step_done_at=[105.0, 106.0],
        job_started_at=100.0,
        finished_at=130.0,
        torch_version="2.x",
    )
    assert REQUIRED <= summary.keys()
    assert summary["hosts"] == {"a": [0], "b": [1]}
    assert summary["num_hosts"] == 2 and summary["epochs"] == 2
    assert summary["train_loss"] == 0.5 and summary["eval_accuracy"] == 0.9
    assert summary["images_per_second"] == pytest.approx(128 / 0.8)  # all images over the slowest rank
    assert summary["rank_step_time_s"] == pytest.approx([0.2, 0.3])
    assert summary["rank_data_wait_s"] == pytest.approx([0.01, 0.1])
    assert summary["rank_compute_s"] == pytest.approx([0.05, 0.06])
    assert summary["step_time_s"]["max"] == pytest.approx(0.3)
    assert summary["time_to_first_step_s"] == pytest.approx(6.0)
    assert summary["wall_time_s"] == pytest.approx(30.0)
    json.dumps(summary)


def test_process_start_time_is_in_the_recent_past():
    started = process_start_time()
    assert 0 <= time.time() - started < 3600


@pytest.mark.parametrize("num_samples, world_size", [(359, 2), (359, 3), (10, 4), (3, 8)])
def test_eval_shards_cover_every_sample_exactly_once(num_samples, world_size):
    seen = [i for rank in range(world_size) for i in EvalShardSampler(num_samples, rank, world_size)]
    assert sorted(seen) == list(range(num_samples))


def test_digits_split_is_deterministic_stratified_and_disjoint():
    train, test = digits_split(seed=0)
    train_again, test_again = digits_split(seed=0)
    assert len(train) + len(test) == 1797
    assert abs(len(test) - 0.2 * 1797) < 10
    assert (test.tensors[0] == test_again.tensors[0]).all()
    assert set(test.tensors[1].tolist()) == set(range(10))
    assert train.tensors[0].shape[1:] == (1, 8, 8)
    train_rows = {tuple(row.flatten().tolist()) for row in train.tensors[0]}
    overlap = sum(tuple(row.flatten().tolist()) in train_rows for row in test.tensors[0])
    assert overlap < 5  # the digits set has a few exact duplicate images; no systematic leak


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "summary.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_atomic_write_failure_keeps_previous_file(tmp_path):
    target = tmp_path / "summary.json"
    write_json_atomic(target, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(target, {"a": object()})
    assert json.loads(target.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_the_straggler_line_names_the_rank_and_what_slows_it():
    from mpiddp.tools.report import straggler_line

    slow_loader = [{"rank_step_time_s": [0.2, 0.2, 0.2], "rank_data_wait_s": [0.01, 0.01, 0.09],
                    "rank_compute_s": [0.1, 0.1, 0.1]}]
    assert straggler_line(slow_loader).endswith("rank 2 is a straggler (1.73x the others' median: waiting for data)")
    slow_gpu = [{"rank_step_time_s": [0.2, 0.2], "rank_data_wait_s": [0.0, 0.0], "rank_compute_s": [0.1, 0.05]}]
    # held against the other rank, not a median of two that includes itself (that would read 1.33x)
    assert straggler_line(slow_gpu).endswith("rank 0 is a straggler (2.00x the others' median: computing)")
    even = [{"rank_step_time_s": [0.2, 0.2], "rank_data_wait_s": [0.0, 0.0], "rank_compute_s": [0.1, 0.1]}]
    assert straggler_line(even).endswith("no straggler")
    older_run = [{"rank_step_time_s": [0.1, 0.3]}]  # written before the split was recorded
    assert straggler_line(older_run) == "mean step time per rank: 100.0 ms, 300.0 ms; rank 1 is a straggler (3.00x the others' median)"


class FakeRun:
    def __init__(self, fail_on_log=False):
        self.logged, self.finished, self.fail_on_log = [], False, fail_on_log

    def log(self, values, step):
        if self.fail_on_log:
            raise ConnectionError("service gone")
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_wandb_starts_in_the_background_and_gets_every_record_in_order():
    import threading

    from mpiddp.trainer.metrics import WandbLogger

    may_start, run = threading.Event(), FakeRun()
    logger = WandbLogger(lambda: may_start.wait() and run, "abc123")
    # wandb is still starting: logging does not wait for it
    logger.log({"kind": "start", "step": 0})
    logger.log({"kind": "step", "step": 5, "loss": 1.5, "time": 1.0})
    logger.log({"kind": "epoch", "step": 10, "rank_step_time_s": [0.1, 0.2], "eval_loss": None})
    may_start.set()
    logger.close()
    assert run.logged == [(5, {"step/loss": 1.5}), (10, {"epoch/rank_step_time_s/rank_0": 0.1,
                                                         "epoch/rank_step_time_s/rank_1": 0.2})]
    assert run.finished and logger.run_id == "abc123"


def test_wandb_that_fails_to_start_or_to_log_never_stops_training(caplog):
    from mpiddp.trainer.metrics import WandbLogger

    never_started = WandbLogger(lambda: None, "abc")
    never_started.log({"kind": "step", "step": 1, "loss": 1.0})
    never_started.close()
    broken = FakeRun(fail_on_log=True)
    failing = WandbLogger(lambda: broken, "abc")
    failing.log({"kind": "step", "step": 1, "loss": 1.0})
    failing.log({"kind": "step", "step": 2, "loss": 1.0})
    failing.close()
    assert caplog.text.count("wandb logging failed") == 1 and not broken.finished
