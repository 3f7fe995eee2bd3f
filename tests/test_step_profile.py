"""The profile's split of py-spy's raw stacks into the runtime's parts (pure logic)."""

from __future__ import annotations

import pytest

from .conftest import load_bench

step_profile = load_bench("step_profile")

LAUNCHER = 'process 100:"python -m launcher cluster.nodes=2"'
WORKER = 'process 200:"python -m elastic.trainer"'
LOADER = 'process 300:"python -c from multiprocessing.spawn import spawn_main; spawn_main()"'
BENCH = 'process 400:"python bench/throughput.py --profile /tmp/p"'
PLAIN = 'process 500:"python -c from multiprocessing.spawn import spawn_main"'

RAW = "\n".join(
    [
        # A worker's main thread: compute, the comm hook inside a backward, the sampler.
        f"{LAUNCHER};{WORKER};thread (200);main (elastic/trainer.py:380);"
        "train_step (elastic/trainer.py:300);backward (torch/_tensor.py:600) 50",
        f"{LAUNCHER};{WORKER};thread (200);train_step (elastic/trainer.py:300);"
        "backward (torch/_tensor.py:600);__call__ (elastic/ddp_hook.py:90);"
        "all_reduce (torch/distributed/distributed_c10d.py:2800) 10",
        f"{LAUNCHER};{WORKER};thread (200);train_steps (elastic/trainer.py:250);"
        "plan (elastic/sampler.py:120) 3",
        # Another thread of the worker: the agent link's heartbeat.
        f"{LAUNCHER};{WORKER};thread (201): heartbeat;run (threading.py:1000);"
        "_beat (elastic/agent_link.py:70) 2",
        # Its loader process, and an agent.
        f"{LAUNCHER};{WORKER};{LOADER};thread (300);_worker_loop "
        "(torch/utils/data/_utils/worker.py:300);"
        "__call__ (torchvision/transforms/transforms.py:90) 20",
        f"{LAUNCHER};thread (100);_loop (launcher/agent/agent.py:200) 4",
        # The plain loop's rank under the bench, and the bench itself (left out).
        f"{BENCH};{PLAIN};thread (500): MainThread;plain_worker (bench/throughput.py:540);"
        "backward (torch/_tensor.py:600) 55",
        f"{BENCH};thread (400);_sample (bench/throughput.py:320) 7",
        # A wait that py-spy took for work: left out.
        f"{LAUNCHER};thread (101): etcd3_watch;wait (grpc/_common.py:154);"
        "_wait_once (grpc/_common.py:114);Condition.wait (threading.py:331) 80",
        "a line that is not a stack",
    ]
)


def test_each_stack_counts_for_its_innermost_named_part() -> None:
    parts = step_profile.split(RAW, rate_hz=100, steps=10)  # ms per step = count / 100 * 100
    assert parts == {
        "backward": pytest.approx(50 + 55),  # ours and the plain loop's, in one run here
        "data loading": pytest.approx(20),
        "comm hook": pytest.approx(10),
        "launcher and agents": pytest.approx(4),
        "sampler": pytest.approx(3),
        "agent link (beside the loop)": pytest.approx(2),
    }


def test_the_comparison_lists_ours_extra_cpu_per_part_largest_first() -> None:
    table = step_profile.compare({"compute": 50.0, "comm hook": 10.0}, {"compute": 52.0})
    lines = table.splitlines()
    assert lines[1].split() == ["comm", "hook", "10.0", "0.0", "+10.0"]
    assert lines[2].split() == ["compute", "50.0", "52.0", "-2.0"]
    assert lines[-1].split() == ["all", "sampled", "60.0", "52.0", "+8.0"]
