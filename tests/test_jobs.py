"""Jobs other than the ImageNet classifier: the contract's checks (a wrong ``job._target_`` or
``job.*`` refused, naming what is missing), the language model job's data and loss, the
language model sharded over each node (``parallel.shard=node``) through a campaign of faults with
every invariant checked, and a user's job (the example in docs/your-own-job.md) launched from a
package of its own, through a kill and a resume."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import default_collate

from chaos.injectors import kill_node, node_with_rank
from elastic.config import ConfigError
from elastic.events import read_events
from elastic.job import Job
from elastic.job_target import build_job, job_class, job_problems, job_settings
from elastic.jobs.lm import LanguageModelJob
from elastic.jobs.tokens import TokenSequences
from launcher.compose import compose

from .conftest import REPO, Gate, back_after_restart, launch, output
from .test_chaos_campaign import chaos
from .test_e2e import RECORD, assert_job_invariants, wait_event, wait_exit

CPU = torch.device("cpu")
EXAMPLE = REPO / "examples" / "own_job" / "my_jobs.py"


class Partial(Job):
    """Half a job: no model, no loss."""

    def train_data(self):  # type: ignore[no-untyped-def]
        return []


def refusal(target: str) -> str:
    with pytest.raises(ConfigError) as caught:
        job_class(target)
    return str(caught.value)


def test_a_wrong_target_is_refused_naming_what_is_missing() -> None:
    assert "no module named 'no_such_pkg'" in refusal("no_such_pkg.jobs.MyJob")
    assert "module 'elastic.jobs.lm' has no 'Missing'" in refusal("elastic.jobs.lm.Missing")
    assert "is not a class deriving elastic.job.Job" in refusal("elastic.config.Config")
    assert "is not a module.Class path" in refusal("MyJob")
    partial = refusal(f"{__name__}.Partial")
    assert "Partial does not implement build_model, loss of elastic.job.Job" in partial
    assert "Fix: define build_model(), loss() in Partial" in partial
    assert job_class("elastic.jobs.lm.LanguageModelJob") is LanguageModelJob


def test_job_settings_are_typed_bounded_and_checked_with_the_other_keys() -> None:
    cls = LanguageModelJob
    assert job_settings(cls, {"_target_": "x", "layers": 3}).layers == 3
    with pytest.raises(ConfigError, match=r"job.layers='three': is not of the type"):
        job_settings(cls, {"layers": "three"})
    with pytest.raises(ConfigError, match=r"job.depth=3: LanguageModelJob has no such setting"):
        job_settings(cls, {"depth": 3})
    cfg = compose(["job=lm", "job.layers=0", "job.dim=30"])
    assert list(job_problems(cfg)) == [
        "job.layers=0: must be at least 1. Fix: set job.layers to 1 or more.",
        "job.dim=30: must split evenly into job.heads=4 attention heads. Fix: set job.dim to a "
        "multiple of job.heads.",
    ]
    assert list(job_problems(compose([]))) == []  # the default, job=imagenet


def test_a_launch_with_a_wrong_target_is_refused_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "launcher", "job._target_=my_pkg.jobs.MyJob", f"run_dir={run_dir}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "job._target_='my_pkg.jobs.MyJob': no module named 'my_pkg'" in proc.stderr
    assert not run_dir.exists()  # no config written, no node started


def test_token_sequences_are_the_same_for_a_key_and_follow_their_grammar() -> None:
    data = TokenSequences(vocab=16, length=9, count=50, grammar_seed=1)
    (a,) = data[(0, 7)]
    assert a.shape == (9,) and a.dtype == torch.int64 and int(a.max()) < 16
    assert torch.equal(a, data[(3, 7)][0]) and torch.equal(a, data[7][0])  # any epoch, any rank
    assert not torch.equal(a, data[(0, 8)][0])
    held_out = TokenSequences(vocab=16, length=9, count=5, grammar_seed=1, first=50)
    assert not any(torch.equal(held_out[i][0], data[i][0]) for i in range(5))
    # A learnable language: most next tokens are one of a few successors of the token before.
    pairs = torch.cat([torch.stack([s[:-1], s[1:]], 1) for (s,) in (data[i] for i in range(50))])
    successors = {int(t): set() for t in pairs[:, 0]}
    for t, n in pairs.tolist():
        successors[t].add(n)
    assert sum(len(s) for s in successors.values()) < 0.5 * 16 * len(successors)
    with pytest.raises(IndexError):
        data[(0, 50)]


def test_the_language_model_gives_one_loss_and_accuracy_per_sequence_and_learns() -> None:
    cfg = compose(["job=lm", "job.sequences=64", "job.dim=32", "optim.lr=1.0"])
    job = build_job(cfg, CPU)
    torch.manual_seed(0)
    model = job.build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = job.train_data()
    batch = tuple(default_collate([data[(0, i)] for i in range(64)]))
    first = job.loss(model, batch)
    assert first.per_sample.shape == first.metrics["accuracy"].shape == (64,)
    for _ in range(30):
        optimizer.zero_grad()
        job.loss(model, batch).per_sample.mean().backward()
        optimizer.step()
    learned = job.loss(model, batch)
    assert learned.per_sample.mean() < first.per_sample.mean() - 1.0
    assert learned.metrics["accuracy"].mean() > first.metrics["accuracy"].mean() + 0.1


def test_the_language_model_sharded_over_each_node_trains_through_a_node_lost_and_rejoined(
    tmp_path: Path, gate: Gate
) -> None:
    """job=lm with parallel.shard=node on 3 nodes x 2 workers (HSDP), AdamW with a warm-up from
    0, a cosine decay and clipping over the shards, through conf/campaign/hsdp.yaml: a bit
    flipped in a shard of rank 0, a node SIGKILLed and started again, and a worker of rank 0's
    node killed. The flipped shard is repaired by its replicas; the survivors keep their shards
    and recover in place at 2 x 2 with the LR rescaled; the node that comes back takes the
    survivors' shards from memory; with one worker restarted, rank 0's node holds half a state
    and takes another node's. Every sequence is trained exactly once, and each shard's
    replicas stay alike (the invariants, per shard). Its last 3 steps wait at the gate for the
    restarted node to be back."""
    run_dir = tmp_path / "run"
    sequences = 1440  # 30 steps an epoch at 3 x 2 x 8
    gate.hold_end(3)
    gate.open_on(run_dir, back_after_restart(1))
    code, out = chaos(
        tmp_path,
        "campaign=hsdp",
        "job=lm",
        "parallel.shard=node",
        "cluster.nodes=3",
        "cluster.cpu_workers=2",
        f"job.sequences={sequences}",
        "job.val_sequences=48",
        "job.dim=128",
        "optim.name=adamw",
        "optim.lr=0.01",
        "optim.schedule=cosine",
        "optim.warmup_start=zero",
        "optim.clip_grad_norm=1.0",
        "trainer.epochs=2",
        "trainer.eval_every_epochs=1",
        "health.replica_check_every=5",
        RECORD,
        env=gate.env(),
    )
    assert code == 0, out[-4000:]
    report = json.loads((run_dir / "chaos" / "report.json").read_text())
    assert report["ok"] and all(v == [] for v in report["violations"].values()), report
    assert [f["kind"] for f in report["faults"]] == [
        "replica SIGUSR1",
        "node SIGKILL",
        "worker SIGKILL",
    ], report
    assert "repaired" in report["faults"][0]["breakdown"], report["faults"][0]

    events = read_events(run_dir)
    synced = [e for e in events if e["event"] == "state_synced"]
    assert {e["shard"] for e in synced} == {0, 1}  # each worker holds one of 2 shards
    first, *_ = [e for e in events if e["event"] == "recovered"]
    assert first["in_place"] and first["world_size"] == 4
    assert next(e for e in events if e["event"] == "lr_changed")["world_size"] == 4
    restarted = next(e for e in events if e["event"] == "fault_cleared" and e["kind"] == "restart")
    back = next(
        e
        for e in events
        if e["event"] == "state_synced"
        and e["node"] == restarted["target"]
        and e["ts"] > restarted["ts"]
    )
    assert back["source"] >= 0  # from a survivor's memory, not a checkpoint
    assert not any(e["event"] == "checkpoint_loaded" for e in events)
    done = next(e for e in events if e["event"] == "training_done")
    assert done["samples_seen"] == 2 * sequences
    evaluated = [e for e in events if e["event"] == "evaluated"]
    assert [e["evaluation"] for e in evaluated] == [1, 2]
    assert all(e["count"] == 48 * 32 for e in evaluated)  # every held-out token, once


def test_the_readme_shows_the_example_job_as_it_is() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs/your-own-job.md").read_text(), re.S)
    assert EXAMPLE.read_text() in blocks


def test_a_users_job_from_its_own_package_survives_a_kill_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example job of docs/your-own-job.md, copied into a folder of its own as a user's
    package and named by ``job._target_``: a node SIGKILLed, the invariants hold, the job's own
    state (an average of the weights) is in its checkpoints, and a second launch resumes from the
    last one and trains one more epoch."""
    package = tmp_path / "user_code"
    package.mkdir()
    shutil.copy(EXAMPLE, package / "my_jobs.py")
    monkeypatch.setenv("PYTHONPATH", str(package))  # here, and on every node
    run_dir = tmp_path / "run"
    samples = 1440  # 60 steps an epoch at 3 x 8
    job = ["job._target_=my_jobs.WaveJob", f"+job.samples={samples}", "+job.hidden=32", RECORD]
    proc = launch(run_dir, *job, "cluster.nodes=3", "trainer.epochs=2", job_id="wave")
    wait_event(run_dir, proc, lambda e: e["event"] == "checkpoint_saved" and e["step"] >= 10)
    assert proc.poll() is None, output(run_dir)
    fault = kill_node(run_dir, node_with_rank(run_dir, 2))
    assert wait_exit(proc, run_dir) == 0, output(run_dir)[-3000:]
    events = assert_job_invariants(run_dir, samples, epochs=2)
    recovered = next(e for e in events if e["ts"] > fault and e["event"] == "recovered")
    assert recovered["in_place"] and recovered["world_size"] == 2
    newest = max(e["step"] for e in events if e["event"] == "checkpoint_saved")
    saved = FileSystemReader(str(run_dir / "checkpoints" / f"step_{newest:09d}")).read_metadata()
    assert {"state.job.ema.0.weight", "state.job.ema.4.bias"} <= set(saved.state_dict_metadata)

    relaunched = time.time()
    restart = launch(run_dir, *job, "cluster.nodes=2", "trainer.epochs=3", job_id="wave")
    started = wait_event(
        run_dir, restart, lambda e: e["event"] == "training_started", since=relaunched
    )
    assert started["resumed_from"] == newest and started["samples_seen"] == 2 * samples
    assert wait_exit(restart, run_dir) == 0, output(run_dir)[-3000:]
    events = assert_job_invariants(run_dir, samples, epochs=3)
    done = [e for e in events if e["event"] == "training_done"]
    assert done[-1]["samples_seen"] == 3 * samples
