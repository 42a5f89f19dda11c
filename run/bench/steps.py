"""Step-level in-job recovery of a torchrun-style loop (mpiddp.DistributedDataParallel + mpiddp.Optimizer), under
`mpirun --with-ft ulfm -np 3 python -m mpiddp run tests/programs/steps_loop.py`, on this machine:

  downtime  rank 1 SIGKILLs itself mid-step (after its forward, its peers wait in the all-reduce): from the kill to
            the survivors' next completed step, less one step of the run's median (the step it would have taken
            anyway); the recovery's own line (agree and shrink, process group, state sync)
  cost      nothing fails: iterations per second with the wrappers against torch's DDP and the optimizer itself,
            interleaved pairs (A B, A B, ...), the median of the per-pair ratios

usage: python run/bench/steps.py [--repeats 5] [--width 512] [--iterations 200] [--commit late]
Writes run/bench/results/only-steps.json (--commit late: only-steps-late.json, the wrappers' late commit, forced on
CPU). Not timed in any test: numbers for the docs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROGRAM = REPO / "tests" / "programs" / "steps_loop.py"
OUT = REPO / "run" / "bench" / "results" / "only-steps.json"
MPIRUN = str(Path(sys.executable).parent / "mpirun")
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe", PYTHONUNBUFFERED="1")


def run(iterations: int, width: int, *extra: str) -> tuple[dict[int, list[dict]], str]:
    out = Path(tempfile.mkdtemp())
    command = [MPIRUN, "--with-ft", "ulfm", "-np", "3", sys.executable, "-m", "mpiddp", "run", str(PROGRAM),
               str(out), str(iterations), "--width", str(width), *extra]
    print("+ " + " ".join(command), flush=True)
    done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    lines = {int(path.stem[4:]): [json.loads(line) for line in path.read_text().splitlines()]
             for path in out.glob("rank*.jsonl")}
    return lines, done.stdout + done.stderr


def rate(lines: dict[int, list[dict]], skip: int = 10) -> float:
    """Iterations per second of rank 0 after `skip` warm-up iterations."""
    steps = [line for line in lines[0] if "iteration" in line][skip:]
    return (len(steps) - 1) / (steps[-1]["time"] - steps[0]["time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--commit", default="strict", choices=("strict", "late"))
    args = parser.parse_args()
    commit = ("--commit", args.commit)
    downtimes, recovery_lines = [], []
    for _ in range(args.repeats):
        lines, output = run(60, args.width, "--kill", "1:30", *commit)
        killed = next(line["killed"] for line in lines[1] if "killed" in line)
        steps = [line for line in lines[0] if "iteration" in line]
        durations = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
        after = next(line["time"] for line in steps if line["time"] > killed)
        downtimes.append(after - killed - statistics.median(durations))
        recovery_lines += [line for line in output.splitlines() if "state sync" in line]
    pairs = []
    for _ in range(args.repeats):
        wrapped, _ = run(args.iterations, args.width, *commit)
        plain, _ = run(args.iterations, args.width, "--plain")
        pairs.append((rate(wrapped), rate(plain)))
    result = {
        "machine": f"{os.cpu_count()} CPU cores", "ranks": 3, "width": args.width, "commit": args.commit,
        "downtime_s": {"median": statistics.median(downtimes), "runs": downtimes},
        "recovery_lines": recovery_lines,
        "cost": {"wrapped_iterations_per_s": [a for a, _ in pairs], "plain_iterations_per_s": [b for _, b in pairs],
                 "median_ratio": statistics.median(a / b for a, b in pairs)},
    }
    out = OUT if args.commit == "strict" else OUT.with_name(f"only-steps-{args.commit}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"downtime_median_s": result["downtime_s"]["median"], "cost_ratio": result["cost"]["median_ratio"]}))


if __name__ == "__main__":
    main()
