"""A script written against `mpiddp.init()` that recovers in the job (`mpirun --with-ft ulfm python THIS ...`).

usage: recoverable_script.py OUT_DIR STEPS VICTIM AT_STEP [WHERE]
STEPS: a number, or N+full: N steps, and after a failure on until the job is back at its first size (a grow, whose
new rank warms up while the survivors train on; at most 120 s), then 5 steps more.
A linear model learns y = X w on a fixed synthetic set, at a global batch of 24 samples per step (or
MPIDDP_TEST_GLOBAL_BATCH) whatever the number of ranks: each rank takes its mpiddp.share_global_batch of the step's
samples (unevenly where the global batch does not split), its loss weighted by its share, so every number of ranks
follows the same trajectory. The
VICTIM rank (its rank at the start; -1: nobody), when it reaches step AT_STEP, writes OUT_DIR/victim (its pid) and
waits, outside any collective, for the test's SIGKILL (or its peers' hang watchdogs', after
MPIDDP_TEST_HANG_TIMEOUT s: init's hang_timeout_s); its peers go on into that step's gradient all-reduce (WHERE
"step", the default) or, with WHERE "reduce", into the loss's MPI all-reduce (dist.reduce) after it, and wait there. Each rank writes OUT_DIR/pid.<start rank> when it starts and, if it finishes,
OUT_DIR/final.<start rank>.json: its pid, start and final rank, world size, the step reached, its parameters and
their digest, and the membership changes it saw.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import mpiddp

GLOBAL_BATCH = int(os.environ.get("MPIDDP_TEST_GLOBAL_BATCH", "24"))
NUM_SAMPLES = 240


def main() -> None:
    out, victim, at_step = Path(sys.argv[1]), int(sys.argv[3]), int(sys.argv[4])
    steps, until_full = int(sys.argv[2].split("+")[0]), sys.argv[2].endswith("+full")
    where = sys.argv[5] if len(sys.argv) > 5 else "step"
    dist = mpiddp.init(device="cpu", hang_timeout_s=float(os.environ.get("MPIDDP_TEST_HANG_TIMEOUT", "300")))
    mpiddp.setup_logging(dist)
    first_size, deadline = dist.world_size, time.monotonic() + 120
    full_again = {}  # (+full) the step where the job was back at its first size: 5 more steps at that size
    start_rank = dist.rank
    # a rank that joined a grown job runs this too: its files are named apart from the first ranks'
    key = f"joined.{start_rank}" if (out / f"pid.{start_rank}").exists() else str(start_rank)
    (out / f"pid.{key}").write_text(str(os.getpid()))
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(NUM_SAMPLES, 8, generator=generator)
    targets = inputs @ torch.randn(8, 1, generator=generator)
    torch.manual_seed(1)  # the same initial model everywhere (DDP would broadcast rank 0's anyway)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # momentum: optimizer state to carry
    state = mpiddp.State(model=model, optimizer=optimizer, step=0, losses=[])
    changes = []
    mpiddp.on_membership_change(changes.append)

    def train(state: mpiddp.State) -> None:
        ddp = mpiddp.watch_gradients(DDP(state.model))  # wrapped anew on every (re-)entry: the group may be new
        share = mpiddp.share_global_batch(GLOBAL_BATCH, GLOBAL_BATCH)  # re-split on every entry: after a recovery
        # and after a grow (one micro-batch a rank)
        # below full size each rank looks at its own clock (the survivors alike: one process each); back at full
        # size only the shared step counts, so that a rank that joined late cannot leave at another step
        while state.step < steps or (until_full and (
                (dist.world_size < first_size and time.monotonic() < deadline)
                or (dist.world_size == first_size and state.step < full_again.setdefault("step", state.step) + 5))):
            stalls = key == str(victim) and state.step == at_step
            if stalls and where == "step":
                stall(out)
            batch = [(state.step * GLOBAL_BATCH + position) % NUM_SAMPLES for position in share.positions]
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(inputs[batch]), targets[batch])
            (loss * share.loss_scale(len(batch))).backward()  # the all-reduce: a peer's death raises here, under
            # MPI's failure watch
            if stalls and where == "reduce":
                stall(out)
            (mean,) = dist.reduce([loss.item()], "mean")  # MPI: a failure here is recovered too
            optimizer.step()
            state.step += 1
            state.losses = state.losses + [round(mean, 6)]
            state.commit()  # nothing communicates between the optimizer step and the commit

    mpiddp.run_recoverable(train, state)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    record = {"pid": os.getpid(), "start_rank": start_rank, "key": key, "rank": dist.rank, "world_size": dist.world_size,
              "step": state.step, "digest": digest, "losses": len(state.losses),
              "parameters": [value for p in model.parameters() for value in p.detach().flatten().tolist()],
              "changes": [{"world_before": c.world_before, "world_size": c.world_size, "ranks_lost": list(c.ranks_lost),
                           "ranks_added": list(c.ranks_added), "hosts_added": list(c.hosts_added),
                           "hosts_lost": list(c.hosts_lost), "synced_from": c.synced_from, "phases": c.phases}
                          for c in changes]}
    (out / f"final.{key}.json").write_text(json.dumps(record))


def stall(out: Path) -> None:
    (out / "victim.tmp").write_text(str(os.getpid()))
    (out / "victim.tmp").rename(out / "victim")
    while True:  # until the test's SIGKILL
        time.sleep(0.01)


if __name__ == "__main__":
    main()
