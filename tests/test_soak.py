"""The soak bench's short form on the real job (bench/soak.py): nodes killed and started again
while the survivors rebuild in place, every agent and worker sampled after each recovery
(chaos/resources.py). Before the hook's tensors were kept per bucket, a survivor's worker grew by
the model's gradients (45 MB for ResNet-18) at every rebuild."""

from __future__ import annotations

from pathlib import Path

from chaos.resources import WARMUP

from .conftest import FAST_JOB
from .test_resources import soak

# Generous: the leak of the gradient buckets per rebuild was 45 MB. A run this short is still
# warming up (allocator pools, the hook's two bucket layouts: about 10 MB a recovery over the
# first eight here, then flat in bench/soak.py's longer runs); descriptors and threads wander by
# a few between samples. An agent holds no tensors.
MAX_WORKER_MB_PER_RECOVERY = 25.0
MAX_AGENT_MB_PER_RECOVERY = 2.0
MAX_FDS_PER_RECOVERY = 4.0
MAX_THREADS_PER_RECOVERY = 2.0


def test_survivors_stay_flat_in_memory_descriptors_and_threads_across_rebuilds(
    tmp_path: Path,
) -> None:
    """A node other than rank 0's killed every 40 steps and started again: each kill and each
    return is a rebuild in place of rank 0's worker, and the job ends by itself, its invariants
    (every sample once, replicas identical, the LR) kept."""
    args = soak.parse(
        [
            "--faults=4",
            "--every-steps=40",
            "--kinds=kill_node",
            "--restart-after-s=0.5",
            "--ckpt-every=5",
            "--epochs=17",
            *(a for a in FAST_JOB if not a.startswith("checkpoint.")),
        ]
    )
    s = soak.run(args, tmp_path / "run")
    table = soak.table(s)
    assert s.ok, table
    assert s.recoveries >= WARMUP + 4, table
    bounds = {"worker": MAX_WORKER_MB_PER_RECOVERY, "agent": MAX_AGENT_MB_PER_RECOVERY}
    for role, bound in bounds.items():
        grown = s.growth[role].per_recovery
        assert grown["rss_mb"] < bound, table
        assert grown["fds"] < MAX_FDS_PER_RECOVERY, table
        assert grown["threads"] < MAX_THREADS_PER_RECOVERY, table
    assert s.etcd[-1][1] > s.etcd[0][1], table  # etcd was sampled as the job went
