"""Growing back onto a hot spare, the trainer and a script side by side, interleaved on the same four fake hosts:
run/bench/grow.py's hot-spare run (the built-in trainer, rank 1 killed after step KILL_AT) and
run/bench/step_grow.py's run (a nanoGPT-shaped loop under mpiddp's step wrappers, rank 1 killed in iteration
KILL_AT), one of each per repeat, so both see the same machine load. Per kind: how many grew, ended with status 0,
had the launcher fail or left anything running, and the survivors' stand-still less an ordinary step (median, max)
with the phases. Writes run/bench/results/only-grow-both.json (or --out).

usage: sudo python run/bench/grow_both.py [--repeats 10]   (root: fake hosts are network namespaces)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
for tier in ("", "common", "job", "elastic", "trainer", "script"):  # the tests' helpers, as setup.cfg's pythonpath
    sys.path.insert(0, str(REPO / "tests" / tier))

import grow as trainer_grow  # noqa: E402  (run/bench/grow.py)
import step_grow  # noqa: E402  (run/bench/step_grow.py)

RESULT = REPO / "run" / "bench" / "results" / "only-grow-both.json"


def one_of_each(hosts, work: Path) -> list[dict]:
    """The trainer's run, then the script's; a run that never got so far is counted, not dropped."""
    from _pytest.outcomes import OutcomeException

    runs = []
    for kind in ("trainer", "script"):
        (work / kind).mkdir()
        try:
            # 8 epochs: at 3 (grow.py's) an idle machine ended the training before the spare was warm
            run = (trainer_grow.one_run(hosts, work / kind, "hot", "gloo", extra=("--epochs", "8"))
                   if kind == "trainer" else
                   step_grow.one_run(hosts, work / kind, step_grow.KILL_AT))
        except (Exception, OutcomeException) as exc:
            run = {"mode": "hot", "status": None, "launcher_failed": True, "pmix_errors": 0, "left_running": 0,
                   "grew": False, "same_parameters": False, "failed": True, "error": str(exc)[-3000:]}
        runs.append({"kind": kind, **run})
        print(json.dumps(runs[-1]), flush=True)
    return runs


def main() -> None:
    from fakehosts import FakeHosts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULT, help="where the results go (default: %(default)s)")
    args = parser.parse_args()
    os.chdir(REPO)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        hosts = FakeHosts(["nodea", "nodeb", "nodec", "noded"], Path(tmp), tag="w").up()
        try:
            for repeat in range(args.repeats):
                work = Path(tmp) / f"repeat{repeat}"
                work.mkdir()
                runs += one_of_each(hosts, work)
        finally:
            hosts.down()
    summary = {"trainer": trainer_grow.summarise([r for r in runs if r["kind"] == "trainer"]),
               "script": step_grow.summarise([r for r in runs if r["kind"] == "script"])}
    args.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cores": os.cpu_count(),
                                    "python": platform.python_version(), "summary": summary, "runs": runs},
                                   indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
