"""`report` on the runs the trainer writes, without MPI: epochs with different rank counts (an in-job recovery, a
grow), a stop and its resume, and the straggler verdict at any rank count."""

import json

import pytest

from mpiddp.elastic import decide
from mpiddp.tools import report

PNG = b"\x89PNG\r\n\x1a\n"


def epoch(number, step, ranks_busy, wait_share=0.25):
    """An epoch line as training_record + epoch_record write it: per rank, in that epoch's rank order."""
    return {"kind": "epoch", "epoch": number, "step": step, "train_loss": 2.0 / number, "eval_loss": 1.0 / number,
            "eval_accuracy": 0.5 + 0.05 * number, "images_per_second": 900.0, "epoch_time_s": 1.5, "lr": 0.1,
            "time": 1000.0 + 10 * number,
            "rank_step_time_s": [0.02] * len(ranks_busy),
            "rank_data_wait_s": [b * wait_share for b in ranks_busy],
            "rank_compute_s": [b * (1 - wait_share) for b in ranks_busy]}


def start(step, world_size, epoch_number=0):
    return {"kind": "start", "epoch": epoch_number, "step": step, "world_size": world_size, "time": 990.0 + step,
            "resumed_from": None if step == 0 else f"ckpt/step_{step}.pt", "process_started_at": 980.0 + step,
            "rendezvous_at": 985.0 + step, "restored_at": 986.0 + step}


def steps(first, last, epoch_number, every=5):
    return [{"kind": "step", "epoch": epoch_number, "step": s, "loss": 2.0 / s, "lr": 0.1, "images_per_second": 800.0,
             "time": 1000.0 + s / 10} for s in range(first, last + 1, every)]


def write_run(run_dir, records, summary=None):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def summary_of(world_size, recoveries):
    return {"arch": "digits_cnn", "dataset": "digits", "world_size": world_size, "num_hosts": 1, "backend": "gloo",
            "device": "cpu", "epochs": 4, "images_per_second": 900.0, "wall_time_s": 60.0,
            "time_to_first_step_s": 3.0, "recoveries": recoveries}


LOST = {"cause": "process_failed", "step": 25, "ranks_lost": [2], "hosts_lost": [], "world_before": 3,
        "world_after": 2, "steps_lost": 0, "phases": {"detect": 0.1, "agree_and_shrink": 0.3}}
GREW = decide.grow_record(45, [2], [], 2, 3, {"spawn": 2.0, "merge": 0.1})


# 3 ranks, one lost in epoch 2 (its line has 2 ranks), grown back to 3 in epoch 3; rank 2 is slow where it is
RECOVERED_AND_GROWN = [start(0, 3), {"kind": "first_step", "step": 1, "time": 995.0},
                       *steps(5, 20, 1), epoch(1, 20, [0.010, 0.010, 0.030]),
                       *steps(25, 40, 2), epoch(2, 40, [0.010, 0.010]),
                       *steps(45, 60, 3), epoch(3, 60, [0.010, 0.010, 0.030]),
                       *steps(65, 80, 4), epoch(4, 80, [0.010, 0.010, 0.030])]


@pytest.mark.parametrize("shape", ["recovered then grown", "recovered past epoch 1", "grown past epoch 1"])
def test_report_draws_a_run_whose_epochs_had_different_rank_counts(tmp_path, capsys, shape):
    records = {
        "recovered then grown": RECOVERED_AND_GROWN,
        "recovered past epoch 1": [start(0, 3), *steps(5, 20, 1), epoch(1, 20, [0.010, 0.010, 0.030]),
                                   *steps(25, 40, 2), epoch(2, 40, [0.010, 0.010])],
        "grown past epoch 1": [start(0, 2), *steps(5, 20, 1), epoch(1, 20, [0.010, 0.010]),
                               *steps(25, 40, 2), epoch(2, 40, [0.010, 0.010, 0.030])],
    }[shape]
    run_dir = write_run(tmp_path / "run", records, summary_of(3, [LOST, GREW]))
    assert report.main([str(run_dir)]) == 0
    for name in ("loss.png", "accuracy.png", "throughput.png", "rank_step_time.png"):
        assert (run_dir / name).read_bytes()[:8] == PNG, name
    out = capsys.readouterr().out
    assert "in-job recoveries: 2" in out
    per_rank = next(line for line in out.splitlines() if line.startswith("mean data wait + compute per rank: "))
    assert per_rank.count(" ms") == 3, per_rank  # every rank that trained, the grown one too


def test_each_rank_is_averaged_over_the_epochs_it_was_in():
    epochs = [r for r in RECOVERED_AND_GROWN if r["kind"] == "epoch"]
    assert report.rank_means(epochs, "rank_compute_s") == pytest.approx([0.0075, 0.0075, 0.0225])  # not / 4
    busy = report.rank_series(epochs, ("rank_data_wait_s", "rank_compute_s"))
    assert [[number for number, _ in points] for points in busy] == [[1, 2, 3, 4], [1, 2, 3, 4], [1, 3, 4]]
    assert busy[2][0][1] == pytest.approx(0.030)
    # rank 2, 3x the others in every epoch it was in, is named though epoch 2 had no rank 2
    assert "rank 2 is a straggler (3.00x the others' median: computing)" in report.straggler_line(epochs)


def test_a_stopped_and_resumed_run_reports_as_one_run(tmp_path, capsys):
    """A stop at step 27 (its snapshot at 25): the resumed job's start record drops the steps it redid."""
    records = [start(0, 2), *steps(5, 20, 1), epoch(1, 20, [0.010, 0.010]), *steps(25, 25, 2),
               {"kind": "step", "epoch": 2, "step": 27, "loss": 0.3, "lr": 0.1, "images_per_second": 800.0,
                "time": 1003.0},
               start(25, 3, epoch_number=1), *steps(30, 40, 2), epoch(2, 40, [0.010, 0.010, 0.011])]
    run_dir = write_run(tmp_path / "run", records)
    assert report.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "no summary.json" in out and "over epochs 1-2" in out and "no straggler" in out
    kept = report.read_run(run_dir)[0]
    assert [r["step"] for r in kept if r["kind"] == "step"] == [5, 10, 15, 20, 25, 30, 35, 40]


@pytest.mark.parametrize("num_ranks", [2, 3, 8])
@pytest.mark.parametrize("cause", ["computing", "waiting for data"])
def test_a_rank_slower_than_its_peers_is_named_at_any_rank_count(num_ranks, cause):
    busy = [0.010] * num_ranks
    busy[num_ranks - 1] = 0.0121  # 1.21x the others (with itself in the median, 2 ranks read 1.10x)
    share = 0.25 if cause == "computing" else 0.0
    record = epoch(1, 20, busy, share)
    if cause == "waiting for data":  # the slow rank's extra time is all in its wait for the loader
        record["rank_compute_s"] = [0.010] * num_ranks
        record["rank_data_wait_s"] = [b - 0.010 for b in busy]
    line = report.straggler_line([record])
    assert f"rank {num_ranks - 1} is a straggler (1.21x the others' median: {cause})" in line, line


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_ranks_within_a_tenth_of_each_other_have_no_straggler(num_ranks):
    busy = [0.010] * num_ranks
    busy[0] = 0.0105
    assert report.straggler_line([epoch(1, 20, busy)]).endswith("; no straggler")


def test_a_run_from_before_the_split_names_the_straggler_by_step_time():
    record = {"kind": "epoch", "epoch": 1, "step": 20, "rank_step_time_s": [0.010, 0.0125]}
    assert report.straggler_line([record]).endswith("rank 1 is a straggler (1.25x the others' median)")
