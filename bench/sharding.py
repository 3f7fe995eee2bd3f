"""What ``parallel.shard=node`` costs and saves against ``parallel.shard=none``, in one sitting.

The same job twice, the language model on 3 nodes x 2 workers, once sharded over each node's
workers (HSDP) and once as plain DDP, through the same campaign (``--campaign``, by default
conf/campaign/hsdp.yaml: a node killed and started again, a shard corrupted, a worker killed).
From each run's event log (rank 0's ``recovered`` events and every worker's ``state_synced``):

- the stall of the first fault, a killed node (the survivors recover in place);
- that recovery's rebuild (the group, and under HSDP the mesh and the re-meshed model) and its
  state sync;
- the state sync of the round the restarted node rejoins in (it receives a survivor's state);
- what a worker holds of the weights and the optimizer state (``state_mib``; its gradients are
  the weights' size again, sharded alike under HSDP);
- the samples a second at 3 nodes (the median of the progress lines, the first 3 steps left out).

    .venv/bin/python bench/sharding.py                      # about 6 minutes
    .venv/bin/python bench/sharding.py --dim 256            # a larger model
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from elastic import event_types as ev
from elastic.events import read_events

JOB = [
    "job=lm",
    "cluster.nodes=3",
    "cluster.cpu_workers=2",
    "job.sequences=1440",
    "job.val_sequences=0",
    "optim.name=adamw",
    "optim.lr=0.01",
    "optim.clip_grad_norm=1.0",
    "trainer.epochs=6",  # long enough for the killed node to be back before the end, in both
    "trainer.tensorboard=false",
    "trainer.record_samples=true",  # the invariants' record
    "health.replica_check_every=5",  # finds the corrupted shard
    "checkpoint.every_steps=10",
    "rendezvous.lease_ttl_s=2",
    "rendezvous.settle_s=0.5",
    "data.batch_size=8",
]


def run(shard: str, campaign: str, dim: int, work: Path) -> dict[str, Any]:
    """One campaign at ``parallel.shard=shard``: the figures of its event log and report."""
    run_dir = work / shard
    done = subprocess.run(
        [sys.executable, "-m", "chaos", f"campaign={campaign}", f"run_dir={run_dir}"]
        + [f"job_id={shard}", f"parallel.shard={shard}", f"job.dim={dim}", *JOB],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if done.returncode != 0:
        raise SystemExit(f"the {shard} campaign failed:\n{(done.stdout + done.stderr)[-3000:]}")
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    events = read_events(run_dir)
    recovered = [e for e in ev.RECOVERED.of(events) if e["rank"] == 0]
    rejoin = next((e for e in recovered[1:] if e["world_size"] == 6), None)
    return {
        "stall of a killed node, s": report["faults"][1]["stall_s"],
        "its rebuild, s": recovered[0]["rebuild_s"],
        "its state sync, s": recovered[0]["sync_s"],
        "state sync as the node rejoins, s": rejoin["sync_s"] if rejoin else None,
        "weights + optimizer state a worker holds, MiB": max(
            e["state_mib"] for e in ev.STATE_SYNCED.of(events)
        ),
        "samples/s at 3 nodes, median": statistics.median(
            e["samples_per_s"] for e in ev.STEP.of(events) if e["world_size"] == 6 and e["step"] > 3
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--campaign", default="hsdp", help="a conf/campaign/ name")
    parser.add_argument("--dim", type=int, default=128, help="job.dim: the model's width")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sharding-bench-"))
    figures = {}
    for shard in ("node", "none"):
        print(f"campaign {args.campaign} at parallel.shard={shard} ...", flush=True)
        figures[shard] = run(shard, args.campaign, args.dim, work)
    print(f"\njob=lm job.dim={args.dim}, 3 nodes x 2 workers ({work})")
    print("| figure | shard=node | shard=none | node / none |\n| --- | --- | --- | --- |")
    for name in figures["node"]:
        a, b = figures["node"][name], figures["none"][name]
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        print(f"| {name} | {_shown(a)} | {_shown(b)} | {ratio} |")
    return 0


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
