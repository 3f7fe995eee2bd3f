"""Health checks: real resource limits in child processes, a real etcd, a real hung child; the
judgement of GPU readings as pure logic, and the GPU path itself when a GPU is present. And what
start-up costs: the doctor loads no torch on a CPU node, a checkpoint is sized from its manifest,
and the device is decided without CUDA where there can be no GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.config import Config, HealthConfig
from elastic.manifest import MANIFEST, newest_manifest
from launcher.agent.slots import device_without_cuda, gpu_device_nodes, layout_refusal
from launcher.health import checks as health
from launcher.health.checks import (
    _clock_against,
    check_checkpoint_disk,
    check_etcd_and_clock,
    check_shm,
    checkpoint_bytes,
    checkpoints_to_fit,
)
from launcher.health.gpu import _read_lines, gpu_checks, judge_nvml, judge_probes, run_probe
from launcher.health.node_report import CheckResult, HealthReport, Status

from .conftest import REPO, with_limit


def on_device(device: str) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, device=device))


def run_check(check: str, limit: tuple[str, int, int], **health: object) -> dict:
    """Run one limit check in a child under a really lowered ``limit`` (name, soft, hard)."""
    code = (
        "import json, dataclasses\n"
        "from elastic.config import HealthConfig\n"
        f"from launcher.health.checks import {check}\n"
        f"r = {check}(HealthConfig(**{health!r}))\n"
        "print(json.dumps({'status': r.status.value, 'message': r.message}))\n"
    )
    out = subprocess.run(
        with_limit([sys.executable, "-c", code], *limit),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_open_files_below_minimum_fails_naming_the_limit_and_fix() -> None:
    r = run_check("check_open_files", ("RLIMIT_NOFILE", 256, 256))
    assert r["status"] == "fail"
    assert "RLIMIT_NOFILE is 256" in r["message"]
    assert "health.min_open_files=4096" in r["message"] and "Fix:" in r["message"]


def test_open_files_soft_limit_is_raised_to_the_hard_one() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4096:
        pytest.skip(f"this machine's hard RLIMIT_NOFILE is {hard}")
    r = run_check("check_open_files", ("RLIMIT_NOFILE", 512, hard))
    assert r["status"] == "pass"
    assert f"RLIMIT_NOFILE {hard}" in r["message"] and "raised from 512" in r["message"]


def test_stack_below_minimum_fails_and_a_low_soft_limit_is_raised() -> None:
    mb = 1 << 20
    r = run_check("check_stack", ("RLIMIT_STACK", 2 * mb, 4 * mb))
    assert r["status"] == "fail"
    assert "RLIMIT_STACK is 4 MB (hard limit 4 MB)" in r["message"]
    assert "health.min_stack_mb=8" in r["message"]
    r = run_check("check_stack", ("RLIMIT_STACK", 2 * mb, 16 * mb), min_stack_mb=16)
    assert r["status"] == "pass" and "raised from 2 MB" in r["message"], r


def test_doctor_prints_a_failing_report_and_exits_non_zero() -> None:
    """The doctor with a lowered open-file limit: JSON, one failure, the GPU checks skipped."""
    proc = subprocess.run(
        with_limit(
            [sys.executable, "-m", "launcher.commands.doctor", "--json", "cluster.device=cpu"],
            "RLIMIT_NOFILE",
            256,
            256,
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    report = HealthReport.from_json(proc.stdout)
    status = {r.name: r.status for r in report.results}
    assert [r.name for r in report.failures] == ["open_files"]
    assert status["gpu"] is Status.SKIP and status["etcd"] is Status.PASS
    table = subprocess.run(
        [sys.executable, "-m", "launcher.commands.doctor", "cluster.device=cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert table.returncode == 0, table.stdout + table.stderr
    assert "fit to join" in table.stdout and "open_files" in table.stdout


def test_doctor_refuses_an_unknown_key() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.commands.doctor", "health.min_open_file=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "health.min_open_file" in proc.stderr and "Fix:" in proc.stderr


def test_gpu_checks_skip_on_cpu_and_say_so() -> None:
    cfg = on_device("cpu")
    (row,) = gpu_checks(cfg, slots=1, device="cpu")
    assert row.status is Status.SKIP
    assert "cluster.device=cpu" in row.message and "skipped" in row.message


def test_etcd_and_clock_against_a_real_etcd(etcd_endpoint: str) -> None:
    etcd, clock = check_etcd_and_clock(HealthConfig(), [etcd_endpoint])
    assert etcd.status is Status.PASS and etcd_endpoint in etcd.message
    assert clock.status is Status.PASS and "of etcd's" in clock.message
    etcd, _ = check_etcd_and_clock(HealthConfig(etcd_timeout_s=1), [etcd_endpoint, "127.0.0.1:1"])
    assert etcd.status is Status.WARN and "1/2 endpoints healthy" in etcd.message
    etcd, _ = check_etcd_and_clock(HealthConfig(etcd_timeout_s=1), ["127.0.0.1:1"])
    assert etcd.status is Status.FAIL and "cluster.etcd_endpoints" in etcd.message


def test_clock_skew_fails_only_beyond_the_bound_whatever_the_date_resolution() -> None:
    cfg = HealthConfig(max_clock_skew_s=2.0)
    # Offsets (low, high): the true offset lies within, the Date header having 1 s resolution.
    assert _clock_against(cfg, [(-0.9, 0.1)]).status is Status.PASS
    assert _clock_against(cfg, [(1.5, 2.5)]).status is Status.PASS  # may be within 2 s
    late = _clock_against(cfg, [(4.2, 5.2)])
    assert late.status is Status.FAIL and "+4.2 s" in late.message
    assert "health.max_clock_skew_s=2.0" in late.message
    assert _clock_against(cfg, [(-7.0, -6.0)]).status is Status.FAIL


def test_shm_and_checkpoint_disk_below_minimum(tmp_path: Path) -> None:
    huge = HealthConfig(min_shm_mb=1 << 40, min_checkpoint_free_gb=1 << 30)
    assert check_shm(huge, required=False).status is Status.WARN
    failed = check_shm(huge, required=True)
    assert failed.status is Status.FAIL and "health.min_shm_mb" in failed.message
    cfg = dataclasses.replace(
        Config(), checkpoint=dataclasses.replace(Config().checkpoint, url=f"file://{tmp_path}/ck")
    )
    assert check_checkpoint_disk(cfg).status is Status.PASS
    full = check_checkpoint_disk(dataclasses.replace(cfg, health=huge))
    assert full.status is Status.FAIL and "health.min_checkpoint_free_gb" in full.message
    remote = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, url="s3://b"))
    assert check_checkpoint_disk(remote).status is Status.SKIP


def with_checkpoint_url(url: str, **health_changes: object) -> Config:
    cfg = Config()
    return dataclasses.replace(
        cfg,
        checkpoint=dataclasses.replace(cfg.checkpoint, url=url, keep=1),
        health=dataclasses.replace(cfg.health, **health_changes),
    )


def commit(folder: Path, sizes: dict[str, int] | None, raw: str | None = None) -> None:
    """A checkpoint folder as the trainer leaves it: a manifest listing ``sizes`` (none: an
    interrupted save; ``raw``: a manifest with that text)."""
    folder.mkdir(parents=True)
    files = {name: {"size": size, "sha256": "0" * 64} for name, size in (sizes or {}).items()}
    if raw is not None:
        (folder / MANIFEST).write_text(raw)
    elif sizes is not None:
        (folder / MANIFEST).write_text(json.dumps({"format": 1, "step": 1, "files": files}))


def test_checkpoint_size_comes_from_the_newest_committed_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a checkpoint, its manifest sizes the next ones and no model is built: newer folders
    that are not committed (no manifest, an unreadable one, moved aside) are passed over."""

    def no_model(cfg: Config) -> int:
        raise AssertionError("the model was sized although a checkpoint exists")

    monkeypatch.setattr(health, "model_bytes", no_model)
    root = tmp_path / "ck"
    mb = 1 << 20
    commit(root / "step_000000050", {"__0_0.distcp": 999 * mb})
    commit(root / "step_000000100", {"__0_0.distcp": 300 * mb, ".metadata": 5 * mb})
    commit(root / "step_000000150", None, raw="{not json")
    commit(root / "step_000000200", None)
    commit(root / "step_000000300.corrupt", {"__0_0.distcp": 1})
    cfg = with_checkpoint_url(f"file://{root}", min_checkpoint_free_gb=0.0)
    assert newest_manifest(cfg.checkpoint.url) is not None
    assert checkpoint_bytes(cfg) == checkpoint_bytes(cfg, size_model=False) == 305 * mb
    row = check_checkpoint_disk(cfg, size_model=False)
    # keep=1: two committed checkpoints are on disk already, so room for one more is enough.
    assert row.status is Status.PASS and row.message.endswith("needs 0.30 GB"), row
    huge = tmp_path / "huge"
    commit(huge / "step_000000001", {"__0_0.distcp": 1 << 50})
    row = check_checkpoint_disk(with_checkpoint_url(str(huge)))
    assert row.status is Status.FAIL, row
    assert "room for 1 more checkpoint(s) of 1073741824 MB" in row.message
    assert "checkpoint.keep + 1 = 2 at the peak, 1 on disk" in row.message


def test_the_disk_check_counts_the_checkpoints_already_on_disk() -> None:
    assert checkpoints_to_fit(keep=3, on_disk=0) == 4  # a fresh job: keep + 1 at the peak
    assert checkpoints_to_fit(keep=3, on_disk=2) == 2
    assert checkpoints_to_fit(keep=3, on_disk=3) == 1  # the next save, then the oldest goes
    assert checkpoints_to_fit(keep=1, on_disk=5) == 1  # more than keep (keep lowered): still one


def test_before_the_first_checkpoint_the_doctor_checks_the_floor_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(health, "model_bytes", lambda cfg: 1 << 50)
    cfg = with_checkpoint_url(f"file://{tmp_path}/ck")
    assert checkpoint_bytes(cfg, size_model=False) is None
    row = check_checkpoint_disk(cfg, size_model=False)
    assert row.status is Status.PASS and "needs 1.00 GB" in row.message
    assert "not known before the first one" in row.message
    assert "sizes the job's model on the meta device" in row.message
    full = check_checkpoint_disk(
        with_checkpoint_url(cfg.checkpoint.url, min_checkpoint_free_gb=float(1 << 30)),
        size_model=False,
    )
    assert full.status is Status.FAIL and "health.min_checkpoint_free_gb=" in full.message
    assert "Fix:" in full.message
    # The agent sizes the model instead (here a model too big for any disk).
    assert check_checkpoint_disk(cfg).status is Status.FAIL


def test_device_is_decided_without_cuda_where_there_can_be_no_gpu() -> None:
    gpu = ["/dev/nvidia0"]
    assert device_without_cuda("cpu", gpu, None) == "cpu"
    assert device_without_cuda("cuda", [], "") == "cuda"  # asked for: the GPU checks say why not
    assert device_without_cuda("auto", [], None) == "cpu"
    assert device_without_cuda("auto", [], "0") == "cpu"
    for hidden in ("", " ", "-1", "-1,0"):
        assert device_without_cuda("auto", gpu, hidden) == "cpu", hidden
    for visible in (None, "0", "1,0", "GPU-8f0e", "0,-1"):
        assert device_without_cuda("auto", gpu, visible) is None, visible
    assert device_without_cuda("auto", ["/dev/dxg"], None) is None  # WSL2
    assert isinstance(device_without_cuda(Config().cluster.device, [], None), str)


def test_a_sharded_job_takes_only_nodes_of_its_rounds_worker_count() -> None:
    """Under parallel.shard=node every node runs as many workers as the round's nodes: a node
    short of a GPU is refused with the count to start it with; a job with no round takes any."""
    assert layout_refusal(2, 4, 3, 6) is None
    assert layout_refusal(3, 0, 0, 0) is None  # no round yet
    refused = layout_refusal(1, 4, 3, 6)
    assert refused is not None
    assert refused.startswith("cluster.workers_per_node=1: this node runs 1 workers, and round 4")
    assert "Fix: start this node with cluster.workers_per_node=2" in refused
    assert "workers_per_node=the same number" in (layout_refusal(2, 4, 2, 5) or "")


def torch_modules(importtime: str) -> list[str]:
    """The torch and torchvision modules named in ``python -X importtime`` output."""
    names = [line.rsplit("|", 1)[-1].strip() for line in importtime.splitlines() if "|" in line]
    return [n for n in names if n.split(".")[0] in ("torch", "torchvision")]


def test_doctor_imports_no_torch_on_a_cpu_node(tmp_path: Path) -> None:
    """Start-up costs what it needs: on a node that trains on CPU, and before the first
    checkpoint, the doctor neither asks CUDA nor sizes the model, so torch is never imported."""
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    hidden = {**env, "CUDA_VISIBLE_DEVICES": "-1"}
    runs = [(["cluster.device=cpu"], env), (["cluster.device=auto"], hidden)]
    if device_without_cuda("auto", gpu_device_nodes(), env.get("CUDA_VISIBLE_DEVICES")) == "cpu":
        runs.append((["cluster.device=auto"], env))  # no GPU here: auto must see it unaided
    for overrides, run_env in runs:
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "launcher.commands.doctor", "--json",
             *overrides, f"checkpoint.url=file://{tmp_path}/ck"],
            cwd=REPO, env=run_env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert torch_modules(proc.stderr) == [], overrides
        rows = {r.name: r for r in HealthReport.from_json(proc.stdout).results}
        assert rows["gpu"].status is Status.SKIP
        assert "not known before the first one" in rows["checkpoint_disk"].message


def test_report_round_trips_through_json() -> None:
    report = HealthReport(
        "n0",
        "h",
        1.0,
        0.5,
        (CheckResult("a", Status.PASS, "ok"), CheckResult("b", Status.FAIL, "bad. Fix: x")),
    )
    again = HealthReport.from_json(report.to_json())
    assert again == report and not again.ok and json.loads(report.to_json())["ok"] is False
    assert "NOT fit to join: 1 failed" in report.table()


# --- the GPU readings, judged (pure logic) -----------------------------------------------------


def reading(device: int = 0, **changes: object) -> dict:
    base = {
        "kind": "nvml",
        "device": device,
        "name": "H100",
        "ecc_uncorrected": 0,
        "retired_pending": None,  # row remapping GPUs do not report page retirement
        "remapped_uncorrectable": 0,
        "remap_pending": False,
        "remap_failed": False,
        "temperature_c": 40,
        "clock_event_reasons": 0x4,  # power cap: normal under load
    }
    return {**base, **changes}


def statuses(rows: list[CheckResult]) -> dict[str, Status]:
    return {r.name: r.status for r in rows}


def test_healthy_gpus_pass() -> None:
    rows = judge_nvml([reading(0), reading(1)], HealthConfig())
    assert set(statuses(rows).values()) == {Status.PASS}


def test_damaged_hot_or_slow_gpus_fail_or_warn() -> None:
    cfg = HealthConfig(max_gpu_temp_c=85)
    rows = statuses(
        judge_nvml(
            [
                reading(0, ecc_uncorrected=3),
                reading(1, remap_pending=True),
                reading(2, temperature_c=91),
                reading(3, clock_event_reasons=0x40),
            ],
            cfg,
        )
    )
    assert rows == {
        "gpu_ecc": Status.FAIL,
        "gpu_memory_health": Status.FAIL,
        "gpu_temperature": Status.FAIL,
        "gpu_throttle": Status.WARN,
    }
    strict = judge_nvml([reading(0, clock_event_reasons=0x08)], HealthConfig(fail_on_throttle=True))
    assert statuses(strict)["gpu_throttle"] is Status.FAIL
    remapped = judge_nvml([reading(0, remapped_uncorrectable=2)], cfg)
    assert statuses(remapped)["gpu_memory_health"] is Status.WARN


def test_missing_nvml_warns_with_the_fix() -> None:
    (row,) = judge_nvml(
        [{"kind": "nvml", "error": "nvidia-ml-py is not installed"}], HealthConfig()
    )
    assert row.status is Status.WARN and "elastic-runtime[gpu]" in row.message


def test_probe_results_judged() -> None:
    good = [
        {"kind": "matmul", "device": 0, "fp32_rel_error": 1e-7, "fp16_mismatched": 0,
         "fp16_tflops": 600.0},
        {"kind": "memory", "device": 0, "bytes": 70 << 30, "total": 80 << 30, "wrong": 0},
    ]  # fmt: skip
    rows = statuses(judge_probes(good, devices=1))
    assert rows == {"gpu_matmul": Status.PASS, "gpu_memory": Status.PASS,
                    "gpu_allreduce": Status.SKIP}  # fmt: skip
    corrupt = [{**good[0], "fp16_mismatched": 12}, {**good[1], "wrong": 5}]
    rows = statuses(judge_probes(corrupt, devices=1))
    assert rows["gpu_matmul"] is Status.FAIL and rows["gpu_memory"] is Status.FAIL
    allreduce = {"kind": "allreduce", "devices": 2, "wrong": 1, "bus_gbps": 1.0}
    assert statuses(judge_probes([allreduce], devices=2))["gpu_allreduce"] is Status.FAIL


def test_a_hung_probe_is_killed_and_named_by_its_stage() -> None:
    """A real child that hangs after announcing a stage: killed at the deadline, and the row
    says which GPU and stage hung."""
    hang = (
        "import json, time\n"
        "print(json.dumps({'kind': 'stage', 'stage': 'memory', 'device': 3}), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", hang], stdout=subprocess.PIPE)
    started = time.monotonic()
    lines = _read_lines(proc, timeout_s=3.0)
    assert time.monotonic() - started < 30
    assert proc.poll() is not None
    (row,) = judge_probes(lines, devices=4)
    assert row.status is Status.FAIL
    assert "during the memory probe of GPU 3" in row.message
    assert "health.gpu_probe_timeout_s=3" in row.message


def test_a_crashing_probe_fails_naming_its_stage() -> None:
    """The real probe child, asked for a GPU on a machine without one, crashes in its first
    CUDA stage; the row says where and why."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the probe would not crash")
    lines = run_probe([0], HealthConfig(gpu_probe_timeout_s=120))
    row = judge_probes(lines, devices=1)[-1]
    assert row.name == "gpu_probe" and row.status is Status.FAIL
    assert "crashed" in row.message and "during the cuda_init probe" in row.message
    assert "driver" in row.message


@pytest.mark.gpu
def test_gpu_path_on_a_real_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    cfg = on_device("cuda")
    rows = gpu_checks(cfg, slots=torch.cuda.device_count(), device="cuda")
    print("\n".join(f"{r.name:18} {r.status.value:5} {r.message}" for r in rows))
    assert not [r for r in rows if r.status is Status.FAIL], rows
    assert {"gpu_count", "gpu_matmul", "gpu_memory"} <= {r.name for r in rows}


def test_a_job_whose_class_does_not_import_on_this_node_fails_its_check() -> None:
    assert health.check_job(Config()).status is Status.PASS  # job=imagenet
    cfg = Config(job={"_target_": "users_pkg.jobs.MyJob"})
    found = health.check_job(cfg)
    assert found.status is Status.FAIL
    assert "on this node, job._target_='users_pkg.jobs.MyJob': no module named" in found.message
    report = health.run_checks(cfg, "node0", [], 1, "cpu")  # sizes nothing it cannot build
    assert report.results[0] == found and not report.ok
