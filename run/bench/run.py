"""mpiddp's benchmark suite (not part of the tests): python run/bench/run.py [--repeats 3] [--out DIR]

Each comparison runs its commands interleaved (A B A B ...) and reports medians and the median of the per-pair
ratios, so slow drift of a noisy machine hits both sides alike. Writes DIR/results.json, DIR/results.md and
PNG plots. Prints the exact commands it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the on-disk dataset writers the tests use

PYTHON = sys.executable
MPIRUN = str(Path(PYTHON).parent / "mpirun") if (Path(PYTHON).parent / "mpirun").exists() else "mpirun"
BATCH, STEPS, WARMUP, SIZE = 16, 60, 5, 32
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", CI="true")


def start(command: list[str], suffix: str = "") -> subprocess.Popen:
    print("+ " + " ".join(command) + suffix, flush=True)
    return subprocess.Popen(command, env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# torch 2.15's processes under torchrun sometimes abort at interpreter exit, after the script's last line
# (destroy_process_group done, results written): about one run in four here. Such a run is run again.
TORCH_EXIT_ABORT = "terminate called without an active exception"


def finish(job: subprocess.Popen, retry_on: str | None = None) -> bool:
    """Wait for a started command; fail loudly, unless it failed with `retry_on` in its output (then False)."""
    output, _ = job.communicate()
    if job.returncode != 0:
        if retry_on is not None and retry_on in output:
            print(f"  (failed with {retry_on!r}: run again)", flush=True)
            return False
        sys.exit(f"benchmark command failed ({job.returncode}):\n{output[-3000:]}")
    return True


def run(command: list[str], retry_on: str | None = None, tries: int = 3) -> float:
    """Run, fail loudly, return the launch time (epoch seconds) of the run that succeeded; `retry_on`: a line
    of output that makes a failed run count as not run (at most `tries` runs)."""
    for attempt in range(tries):
        launched = time.time()
        if finish(start(command), retry_on if attempt < tries - 1 else None):
            return launched
    raise AssertionError("unreachable: the last try fails loudly")


def mpiddp_command(ranks: int, run_dir: Path, *flags: str, mpirun_args: tuple[str, ...] = ()) -> list[str]:
    return [MPIRUN, *mpirun_args, "-np", str(ranks), "--bind-to", "none", PYTHON, "-m", "mpiddp", "--run-dir", str(run_dir),
            "--wandb", "disabled", "--no-progress", "--epochs", "1", "--batch-size", str(BATCH),
            "--throughput-warmup-steps", str(WARMUP), "--arch", "resnet18", "--image-size", str(SIZE), *flags]


def mpiddp(ranks: int, work: Path, *flags: str, mpirun_args: tuple[str, ...] = ()) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=work))
    launched = run(mpiddp_command(ranks, run_dir, *flags, mpirun_args=mpirun_args))
    ended = time.time()
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"images_per_second": summary["images_per_second"],
            "launch_to_first_step_s": summary["first_step_done_at"] - launched, "wall_s": ended - launched,
            "startup_s": {phase: entry["seconds"] for phase, entry in summary["startup_s"].items()},
            "compute_s": statistics.mean(summary["rank_compute_s"]), "step_s": statistics.mean(summary["rank_step_time_s"])}


def synthetic(ranks: int, work: Path, steps: int = STEPS, *flags: str, mpirun_args: tuple[str, ...] = ()) -> dict:
    return mpiddp(ranks, work, *synthetic_flags(steps), *flags, mpirun_args=mpirun_args)


def synthetic_flags(steps: int) -> tuple[str, ...]:
    return ("--use_syn", "--steps-per-epoch", str(steps))


def plain_ddp(work: Path, steps: int = STEPS, warmup: int = WARMUP) -> dict:
    out = work / f"plain-{time.time_ns()}.json"
    launched = run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(HERE / "plain_ddp.py"), str(out), str(BATCH), str(steps), str(warmup), str(SIZE)],
                   retry_on=TORCH_EXIT_ABORT)
    ended = time.time()
    result = json.loads(out.read_text())
    return {"images_per_second": result["images_per_second"],
            "launch_to_first_step_s": result["first_step_done_at"] - launched, "wall_s": ended - launched}


def overhead_comparisons(repeats: int, work: Path) -> list[dict]:
    """mpiddp's loop against the hand-written DDP loop under torchrun: on the same gradient path (gloo), what the
    loop itself costs; and with the default --grad-transport auto, what a user gets."""
    a, b = interleave(repeats, lambda: synthetic(2, work, STEPS, "--grad-transport", "gloo"), lambda: plain_ddp(work))
    auto, plain = interleave(repeats, lambda: synthetic(2, work), lambda: plain_ddp(work))
    return [
        compare("overhead vs plain DDP loop, both gloo", "images_per_second", "mpiddp (mpirun)", a,
                "plain DDP (torchrun)", b) | {"target": ">= 0.99"},
        compare("default (--grad-transport auto) vs plain DDP loop", "images_per_second", "mpiddp (mpirun)", auto,
                "plain DDP (torchrun)", plain) | {"target": ">= 1"},
    ]


def startup_comparisons(repeats: int, work: Path) -> list[dict]:
    """A one-step job (resnet18, synthetic, 2 ranks): mpiddp under mpirun vs the hand-written DDP script under
    torchrun; launch to the first finished step, and the whole job from launch to exit."""
    a, b = interleave(repeats, lambda: synthetic(2, work, 1, "--throughput-warmup-steps", "0"),
                      lambda: plain_ddp(work, steps=1, warmup=0))
    phases = {phase: statistics.median(r["startup_s"][phase] for r in a) for phase in a[0]["startup_s"]}
    return [
        compare("start-up: launch to first step (one-step job)", "launch_to_first_step_s", "mpiddp (mpirun)", a,
                "plain DDP (torchrun)", b) | {"target": "<= 0.8", "mpiddp_phases_s": phases},
        compare("start-up: whole one-step job", "wall_s", "mpiddp (mpirun)", a, "plain DDP (torchrun)", b)
        | {"target": "<= 0.8"},
    ]


SAVE_INTERVAL_S = 2.0


def save_benchmark(repeats: int, work: Path) -> list[dict]:
    """What snapshots cost (resnet18, synthetic, 2 ranks, one thread each, --save-interval 2s over 60 steps):
    each save's seconds from its start until every rank agreed it is published (summary.json `snapshots`), and
    what that is per interval. The whole job's time is not compared: on a shared 2-core machine its noise is
    larger than the saves."""
    runs = []
    for _ in range(repeats):
        run_dir = Path(tempfile.mkdtemp(dir=work))
        run(mpiddp_command(2, run_dir, *synthetic_flags(STEPS), "--num-threads", "1",
                           "--save-interval", str(SAVE_INTERVAL_S)))
        summary = json.loads((run_dir / "summary.json").read_text())
        runs.append(summary["snapshots"] | {"images_per_second": summary["images_per_second"]})
    mean_s = statistics.median(r["mean_s"] for r in runs)
    return [{"benchmark": f"snapshot cost: resnet18, 2 ranks, --save-interval {SAVE_INTERVAL_S:g}s over {STEPS} steps",
             "save_s_median": mean_s, "save_s_max": max(r["max_s"] for r in runs),
             "snapshot_bytes": runs[-1]["bytes_last"], "saves_per_job": [r["count"] for r in runs],
             "overhead_at_interval": {f"{interval}": mean_s / seconds for interval, seconds in
                                      (("2s", SAVE_INTERVAL_S), ("1m", 60.0), ("15m", 900.0))},
             "runs": runs}]


def whole_job(command: list[str], retry_on: str | None = None) -> dict:
    started = run(command, retry_on)
    return {"wall_s": time.time() - started}


OWN_SCRIPT = ("run/examples/torchrun_digits.py", "--epochs", "1")


def own_script_comparison(repeats: int) -> dict:
    """The same torchrun-style script, whole job from launch to exit: `mpiddp run` under mpirun vs torchrun."""
    a, b = interleave(
        repeats,
        lambda: whole_job([MPIRUN, "-np", "2", "--bind-to", "none", PYTHON, "-m", "mpiddp", "run", "--log-level",
                           "warning", *OWN_SCRIPT]),
        lambda: whole_job([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *OWN_SCRIPT],
                          TORCH_EXIT_ABORT),
    )
    return compare("own script: whole job", "wall_s", "mpiddp run (mpirun)", a, "torchrun", b) | {"target": "<= 1"}


COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


def solo_jobs_at_once(work: Path, *flags: str) -> dict:
    """Two independent 1-rank jobs started together: two ranks' compute sharing the machine with no
    communication at all, i.e. the most any 2-rank job (any compression) can reach here."""
    run_dirs = [Path(tempfile.mkdtemp(dir=work)) for _ in range(2)]
    jobs = [start(mpiddp_command(1, run_dir, *synthetic_flags(STEPS), *flags), " &") for run_dir in run_dirs]
    for job in jobs:
        finish(job)
    summaries = [json.loads((run_dir / "summary.json").read_text()) for run_dir in run_dirs]
    return {"images_per_second": sum(s["images_per_second"] for s in summaries),
            "compute_s": statistics.mean(s["rank_compute_s"][0] for s in summaries),
            "step_s": statistics.mean(s["rank_step_time_s"][0] for s in summaries)}


def compression_comparisons(repeats: int, work: Path) -> list[dict]:
    """Scaling 1 -> 2 ranks (one thread each) with each gradient compression. Efficiency = 2-rank images/s
    over twice the 1-rank images/s of plain all-reduce (a 1-rank job with a compression hook pays its
    compression cost without any network to save, so it is not the baseline). Each pair runs interleaved."""
    rows = []
    plain = ("--num-threads", "1")
    for kind in COMPRESSIONS:
        flags = (*plain, "--grad-compression", kind, "--powersgd-rank", "4")
        two, one = interleave(repeats, lambda: synthetic(2, work, STEPS, *flags), lambda: synthetic(1, work, STEPS, *plain))
        rows.append(compare(f"scaling 1 -> 2 ranks, --grad-compression {kind}", "images_per_second", "2 ranks", two,
                            "1 rank, plain", one, 2.0)
                    | {"target": ">= 0.9 with bf16" if kind == "bf16" else "efficiency",
                       "compute_per_step_s": {"2 ranks": statistics.median(r["compute_s"] for r in two),
                                              "1 rank": statistics.median(r["compute_s"] for r in one)},
                       "step_s": {"2 ranks": statistics.median(r["step_s"] for r in two),
                                  "1 rank": statistics.median(r["step_s"] for r in one)}})
    both, one = interleave(repeats, lambda: solo_jobs_at_once(work, *plain), lambda: synthetic(1, work, STEPS, *plain))
    rows.append(compare("ceiling: two 1-rank jobs at once (no communication)", "images_per_second", "2 jobs at once",
                        both, "1 rank, plain", one, 2.0)
                | {"target": "the most any compression can reach on this machine",
                   "compute_per_step_s": {"2 jobs at once": statistics.median(r["compute_s"] for r in both),
                                          "1 rank": statistics.median(r["compute_s"] for r in one)}})
    return rows


TRANSPORT_BATCH, TRANSPORT_STEPS = 32, 50
TRANSPORTS = {"gloo": ("--grad-transport", "gloo"), "mpi": ("--grad-transport", "mpi"),
              "mpi + bf16": ("--grad-transport", "mpi", "--grad-compression", "bf16")}


def transport_comparisons(repeats: int, work: Path) -> list[dict]:
    """Scaling 1 -> 2 ranks (one thread each, batch 32) with the gradients carried by gloo, by MPI, and by MPI
    in bf16; every repeat runs the 1-rank job and each 2-rank job in turn, so each pair is interleaved.
    Efficiency = 2-rank images/s over twice the 1-rank images/s; the mpi rows also give the per-repeat ratio
    to the gloo job of the same repeat."""
    plain = ("--num-threads", "1", "--batch-size", str(TRANSPORT_BATCH))
    one: list[dict] = []
    two: dict[str, list[dict]] = {name: [] for name in TRANSPORTS}
    for _ in range(repeats):
        one.append(synthetic(1, work, TRANSPORT_STEPS, *plain))
        for name, flags in TRANSPORTS.items():
            two[name].append(synthetic(2, work, TRANSPORT_STEPS, *plain, *flags))
    rows = []
    for name, runs in two.items():
        row = compare(f"scaling 1 -> 2 ranks, batch {TRANSPORT_BATCH}, --grad-transport {name}", "images_per_second",
                      "2 ranks", runs, "1 rank", one, 2.0)
        row |= {"target": ">= 0.85 with mpi" if name != "gloo" else "efficiency",
                "compute_per_step_s": {"2 ranks": statistics.median(r["compute_s"] for r in runs),
                                       "1 rank": statistics.median(r["compute_s"] for r in one)},
                "step_s": {"2 ranks": statistics.median(r["step_s"] for r in runs),
                           "1 rank": statistics.median(r["step_s"] for r in one)}}
        rows.append(row)
        if name != "gloo":
            rows.append(compare(f"throughput, --grad-transport {name} vs gloo (2 ranks, batch {TRANSPORT_BATCH})",
                                "images_per_second", name, runs, "gloo", two["gloo"]) | {"target": ">= 1.15"})
    allreduce_out = work / "allreduce-hook.json"
    run([MPIRUN, "-np", "2", PYTHON, str(HERE / "allreduce.py"), str(allreduce_out), "cpu"])
    rows.append({"benchmark": "all-reduce by size, 2 ranks", **json.loads(allreduce_out.read_text())})
    return rows


FAULT_TOLERANT = ("--with-ft", "ulfm")


def ft_cost_comparisons(repeats: int, work: Path) -> list[dict]:
    """What in-job recovery costs when nothing fails: the same 2-rank job under `mpirun --with-ft ulfm` (recovery
    on: the MPI failure watch, gloo buckets issued async and waited under it) and under plain `mpirun`,
    interleaved: throughput for the gloo and the MPI gradient transports (batch 32, one thread per rank), and a
    one-step job's start-up (launch to the first step, and to exit)."""
    rows = []
    plain = ("--num-threads", "1", "--batch-size", str(TRANSPORT_BATCH))
    for name in ("gloo", "mpi"):
        flags = (*plain, *TRANSPORTS[name])
        on, off = interleave(repeats, lambda: synthetic(2, work, TRANSPORT_STEPS, *flags, mpirun_args=FAULT_TOLERANT),
                             lambda: synthetic(2, work, TRANSPORT_STEPS, *flags))
        row = compare(f"in-job recovery on vs off, throughput, --grad-transport {name}", "images_per_second",
                      "--with-ft ulfm", on, "plain mpirun", off) | {"target": ">= 0.98"}
        row["step_s"] = {"on": statistics.median(r["step_s"] for r in on),
                         "off": statistics.median(r["step_s"] for r in off)}
        rows.append(row)
    # the late commit (on GPUs by default; forced here): its undo copy and one agreement a step, against the wait
    flags = (*plain, *TRANSPORTS["gloo"])
    late, strict = interleave(repeats, lambda: synthetic(2, work, TRANSPORT_STEPS, *flags, "--commit", "late",
                                                         mpirun_args=FAULT_TOLERANT),
                              lambda: synthetic(2, work, TRANSPORT_STEPS, *flags, "--commit", "strict",
                                                mpirun_args=FAULT_TOLERANT))
    rows.append(compare("in-job recovery on: --commit late vs strict, throughput, --grad-transport gloo (CPU)",
                        "images_per_second", "--commit late", late, "--commit strict", strict)
                | {"target": "a CPU's copy costs; a GPU's is overlapped (run/gpu/prove.sh ft_cost)"})
    one_step = (*synthetic_flags(1), "--throughput-warmup-steps", "0")
    on, off = interleave(repeats, lambda: mpiddp(2, work, *one_step, mpirun_args=FAULT_TOLERANT),
                         lambda: mpiddp(2, work, *one_step))
    for metric in ("launch_to_first_step_s", "wall_s"):
        rows.append(compare(f"in-job recovery on vs off, start-up ({metric})", metric, "--with-ft ulfm", on,
                            "plain mpirun", off) | {"target": "<= 1.02"})
    return rows


GPU_BATCH, GPU_STEPS = 128, 60


def gpu_benchmark(repeats: int, work: Path) -> dict:
    """resnet50, AMP bf16, channels-last, synthetic 224 px: images/s per GPU on 1 GPU and on every local GPU
    (scaling efficiency), and NCCL all-reduce bus bandwidth by size (as nccl-tests defines it)."""
    count = int(subprocess.run([PYTHON, "-c", "import torch; print(torch.cuda.device_count())"], env=ENV,
                               capture_output=True, text=True, check=True).stdout.strip() or 0)
    if count == 0:
        sys.exit("--only gpu needs a CUDA GPU: torch.cuda.device_count() is 0 here")
    flags = ("--device", "cuda", "--arch", "resnet50", "--amp", "bf16", "--channels-last", "--image-size", "224",
             "--num-classes", "1000", "--steps-per-epoch", str(GPU_STEPS), "--throughput-warmup-steps", "10")

    def resnet50(ranks: int) -> dict:
        run_dir = Path(tempfile.mkdtemp(dir=work))
        run([MPIRUN, "-np", str(ranks), "--bind-to", "none", PYTHON, "-m", "mpiddp", "--run-dir", str(run_dir),
             "--wandb", "disabled", "--no-progress", "--epochs", "1", "--batch-size", str(GPU_BATCH), "--use_syn", *flags])
        summary = json.loads((run_dir / "summary.json").read_text())
        return {"images_per_second": summary["images_per_second"],
                "images_per_second_per_gpu": summary["images_per_second"] / ranks,
                "startup_s": summary["startup_s"]}

    one, every = interleave(repeats, lambda: resnet50(1), lambda: resnet50(count))
    allreduce_out = work / "allreduce-cuda.json"
    run([MPIRUN, "-np", str(count), "--bind-to", "none", PYTHON, str(HERE / "allreduce.py"), str(allreduce_out), "cuda"])
    per_gpu_one = statistics.median(r["images_per_second_per_gpu"] for r in one)
    per_gpu_all = statistics.median(r["images_per_second_per_gpu"] for r in every)
    return {
        "gpus": count, "batch_per_gpu": GPU_BATCH,
        "resnet50_bf16_images_per_second_per_gpu": {"1 GPU": per_gpu_one, f"{count} GPUs": per_gpu_all},
        "scaling_efficiency": per_gpu_all / per_gpu_one if per_gpu_one else None,
        "target": ">= 3000 images/s per H100; busbw within 10% of nccl-tests",
        "runs": {"1 GPU": one, f"{count} GPUs": every},
        "allreduce": json.loads(allreduce_out.read_text()),
    }


HANG_TIMEOUT = 10
RELAUNCH_HOSTS = ("nodea", "nodeb", "nodec")
RELAUNCH_FLAGS = ("--no-progress", "--wandb", "disabled", "--log-every", "1")


def relaunch_comparisons(repeats: int, work: Path) -> list[dict]:
    """Downtime of `launch` after a failure, on three fake hosts with one slot each and -np 2 (as
    tests/launch/test_launch_e2e.py): the rank on nodeb killed (SIGKILL) mid-run, then stopped (SIGSTOP) under
    --hang-timeout 10; each relaunches on nodea and nodec. Downtime and its phases come from attempts.json."""
    from fakehosts import FakeHosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        sys.exit(f"--only relaunch: {reason}")
    cluster = FakeHosts(list(RELAUNCH_HOSTS), work).up()
    try:
        killed = [relaunch_once(cluster, work, "kill") for _ in range(repeats)]
        hung = [relaunch_once(cluster, work, "hang") for _ in range(repeats)]
    finally:
        cluster.down()
    return [downtime_row("killed rank (SIGKILL) to the relaunched job's first step", killed, "<= 30 s"),
            downtime_row(f"stopped rank (SIGSTOP, --hang-timeout {HANG_TIMEOUT}) to the relaunched job's first step",
                         hung, f"<= {HANG_TIMEOUT + 30} s (--hang-timeout + 30 s)")]


def relaunch_once(cluster, work: Path, fault: str) -> dict:
    """One supervised run that fails once (`kill`: rank 1 SIGKILLs itself in step 30, after the epoch-1
    snapshot; `hang`: rank 1 is SIGSTOPped once the epoch-1 snapshot is saved) and finishes on the spare."""
    from conftest import rank_pids  # the tests' lookup of a job's rank processes

    run_dir = Path(tempfile.mkdtemp(dir=work))
    flags = (("--epochs", "3", "--inject-fault", "kill:1:30") if fault == "kill"
             else ("--epochs", "4", "--hang-timeout", str(HANG_TIMEOUT)))
    command = [PYTHON, "-m", "mpiddp", "launch", "-H", ",".join(f"{h}:1" for h in RELAUNCH_HOSTS), "-np", "2",
               "--launcher", "mpirun", "--launcher-args", " ".join(cluster.transport_args()), "--",
               "--run-dir", str(run_dir), *RELAUNCH_FLAGS, *flags]
    env = {key: value for key, value in ENV.items() if key != "PRTE_MCA_rmaps_default_mapping_policy"}  # -H slots
    print("+ " + " ".join(command), flush=True)
    launched = time.time()
    job = subprocess.Popen(cluster.command_on("nodea", command), env={**env, "PYTHONUNBUFFERED": "1"}, cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    assert job.stdout is not None
    for line in job.stdout:
        seen.append(line)
        if fault == "hang" and "saved " in line and "snapshot-epoch0001.pt" in line:
            os.kill(rank_pids(run_dir)[1], signal.SIGSTOP)  # rank 1 runs on nodeb; alive but silent, as a wedged GPU
            fault = "stopped"
    job.wait()
    ended = time.time()
    cluster.kill_host("nodeb")  # what the failure left there (a stopped rank)
    if job.returncode != 0:
        sys.exit(f"benchmark command failed ({job.returncode}):\n{''.join(seen)[-3000:]}")
    first = json.loads((run_dir / "attempts.json").read_text())["attempts"][0]
    return {"downtime_s": first["downtime_s"], "phases_s": first["downtime_phases"], "cause": first["cause"],
            "failed_hosts": first["failed_hosts"], "steps_lost": first["steps_lost"], "wall_s": ended - launched}


def downtime_row(name: str, runs: list[dict], target: str) -> dict:
    phases = {phase: statistics.median(r["phases_s"][phase] for r in runs) for phase in runs[0]["phases_s"]}
    return {"benchmark": name, "metric": "downtime_s",
            "median_downtime_s": statistics.median(r["downtime_s"] for r in runs), "median_phases_s": phases,
            "target": target, "runs": runs}


def interleave(repeats: int, a, b) -> tuple[list[dict], list[dict]]:
    first, second = [], []
    for _ in range(repeats):
        first.append(a())
        second.append(b())
    return first, second


def compare(name: str, metric: str, a_name: str, a: list[dict], b_name: str, b: list[dict], scale_b: float = 1.0) -> dict:
    ratios = [x[metric] / (y[metric] * scale_b) for x, y in zip(a, b)]
    return {
        "benchmark": name, "metric": metric, "a": a_name, "b": b_name,
        "a_median": statistics.median(x[metric] for x in a), "b_median": statistics.median(y[metric] for y in b),
        "median_ratio": statistics.median(ratios), "ratios": ratios, "b_scale": scale_b,
        "a_values": [x[metric] for x in a], "b_values": [y[metric] for y in b],
    }


def machine() -> str:
    import torch

    cores = os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.node()}: {cores} CPU cores, {gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def markdown(results: dict) -> str:
    lines = [f"Machine: {results['machine']}; {results['repeats']} interleaved repeats; resnet18 at "
             f"{SIZE}x{SIZE}, batch {BATCH} per rank, gloo on CPU.", "",
             "| benchmark | metric | A | median A | B | median B | median ratio A/B | target |",
             "|---|---|---|---|---|---|---|---|"]
    for row in results["comparisons"]:
        b_label = row["b"] if row["b_scale"] == 1 else f"{row['b']} x {row['b_scale']:g}"
        lines.append(f"| {row['benchmark']} | {row['metric']} | {row['a']} | {row['a_median']:.2f} | {b_label} | "
                     f"{row['b_median']:.2f} | **{row['median_ratio']:.3f}** | {row['target']} |")
    lines += ["", "| bytes | gloo busbw GB/s | MPI busbw GB/s | MPI, mpiddp's hook | MPI, mpiddp's hook, bf16 |",
              "|---|---|---|---|---|"]
    for row in results["allreduce"]["rows"]:
        lines.append(f"| {row['bytes']:,} | {row['gloo_busbw_GBps']:.3f} | {row['mpi_busbw_GBps']:.3f} | "
                     f"{row.get('mpi_hook_busbw_GBps', float('nan')):.3f} | {row.get('mpi_hook_bf16_busbw_GBps', float('nan')):.3f} |")
    return "\n".join(lines) + "\n"


def plots(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results["comparisons"]), figsize=(4 * len(results["comparisons"]), 3.6))
    for ax, row in zip(axes, results["comparisons"]):
        ax.bar([row["a"], row["b"]], [row["a_median"], row["b_median"] * row["b_scale"]], color=["tab:blue", "tab:gray"])
        ax.set_title(f"{row['benchmark']}\nratio {row['median_ratio']:.3f}", fontsize=9)
        ax.set_ylabel(row["metric"], fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "comparisons.png", dpi=110)
    plt.close(fig)

    rows = results["allreduce"]["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["bytes"] for r in rows], [r["gloo_busbw_GBps"] for r in rows], "o-", label="torch gloo")
    ax.plot([r["bytes"] for r in rows], [r["mpi_busbw_GBps"] for r in rows], "s-", label=results["allreduce"]["mpi_library"][:24])
    ax.set(xscale="log", xlabel="bytes per rank", ylabel="bus bandwidth (GB/s)", title="all-reduce, 2 ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "allreduce.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--only", choices=["own-script", "compression", "startup", "gpu", "transport", "overhead",
                                           "save", "relaunch", "ft-cost"], default=None,
                        help="run one comparison and write it to OUT/only-NAME.json (the full results stay)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only:
        work = Path(tempfile.mkdtemp(prefix="mpiddp-bench-"))
        rows = {"own-script": lambda: [own_script_comparison(args.repeats)],
                "compression": lambda: compression_comparisons(args.repeats, work),
                "startup": lambda: startup_comparisons(args.repeats, work),
                "transport": lambda: transport_comparisons(args.repeats, work),
                "overhead": lambda: overhead_comparisons(args.repeats, work),
                "save": lambda: save_benchmark(args.repeats, work),
                "relaunch": lambda: relaunch_comparisons(args.repeats, work),
                "ft-cost": lambda: ft_cost_comparisons(args.repeats, work),
                "gpu": lambda: [gpu_benchmark(args.repeats, work)]}[args.only]()
        (args.out / f"only-{args.only}.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")
        print(json.dumps(rows, indent=2))
        return
    work = Path(tempfile.mkdtemp(prefix="mpiddp-bench-"))
    comparisons = []

    a, b = interleave(args.repeats, lambda: synthetic(2, work), lambda: plain_ddp(work))
    comparisons.append(compare("overhead vs plain DDP loop", "images_per_second", "mpiddp (mpirun)", a,
                               "plain DDP (torchrun)", b) | {"target": ">= 0.98"})
    comparisons.append(compare("start-up: launch to first step", "launch_to_first_step_s", "mpiddp (mpirun)", a,
                               "plain DDP (torchrun)", b) | {"target": "<= 1 (no slower)"})

    # One CPU thread per rank on both sides: each rank gets the same share of the machine, as one GPU each would.
    one, two = interleave(args.repeats, lambda: synthetic(2, work, STEPS, "--num-threads", "1"),
                          lambda: synthetic(1, work, STEPS, "--num-threads", "1"))
    comparisons.append(compare("scaling 1 -> 2 ranks (1 thread each)", "images_per_second", "2 ranks", one, "1 rank",
                               two, 2.0) | {"target": ">= 0.9 (efficiency)"})

    from datagen import write_cifar10

    data_dir = write_cifar10(work / "cifar", per_batch=320, test=64)
    disk, syn = interleave(
        args.repeats,
        lambda: mpiddp(2, work, "--dataset", "cifar10", "--data-dir", str(data_dir), "--num-workers", "1"),
        lambda: synthetic(2, work, steps=50),
    )
    comparisons.append(compare("data: CIFAR-10 files vs synthetic", "images_per_second", "cifar10 on disk", disk,
                               "synthetic", syn) | {"target": "~1 (loader keeps up)"})

    comparisons += startup_comparisons(args.repeats, work)
    comparisons.append(own_script_comparison(args.repeats))
    comparisons += compression_comparisons(args.repeats, work)
    comparisons += [row for row in transport_comparisons(args.repeats, work) if "metric" in row]

    allreduce_out = work / "allreduce.json"
    run([MPIRUN, "-np", "2", PYTHON, str(HERE / "allreduce.py"), str(allreduce_out), "cpu"])
    results = {"machine": machine(), "repeats": args.repeats, "date": time.strftime("%Y-%m-%d %H:%M"),
               "comparisons": comparisons, "allreduce": json.loads(allreduce_out.read_text())}
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(results))
    plots(results, args.out)
    print(markdown(results))
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
