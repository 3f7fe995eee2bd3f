"""The GPU checks: the devices are there, NVML sees no damage, and each one computes.

Everything that touches a GPU runs in a child process (:mod:`launcher.health.gpu_probe`) under
``health.gpu_probe_timeout_s``: the agent never creates a CUDA context (it would hold memory on
every GPU for the whole job), and a hung GPU fails the check instead of hanging the agent. Here,
in the agent, the child is run (:func:`run_probe`) and the JSON lines it prints are judged by pure
functions (:func:`judge_nvml`, :func:`judge_probes`). CPU-only nodes skip all of it and say so,
and never import torch or nvidia-ml-py for it.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from typing import Any

from elastic.config import Config, HealthConfig
from launcher.health.gpu_probe import MATMUL_N
from launcher.health.node_report import CheckResult, Status

# NVML clock event reasons (nvmlClocksEventReason*) that mean the hardware is slowing itself
# down; power capping and idle are normal and are not listed.
SLOWDOWN_REASONS = {
    0x08: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
# fp32 rounding over K = 2048 terms stays near 1e-6 relative; TF32 or corrupted data is far above.
FP32_TOLERANCE = 1e-4
GIB = 1 << 30


def gpu_checks(cfg: Config, slots: int, device: str) -> list[CheckResult]:
    """The GPU rows of the health report; one skip row on a CPU node, which imports no torch."""
    if device != "cuda":
        why = (
            "cluster.device=cpu"
            if cfg.cluster.device == "cpu"
            else f"cluster.device={cfg.cluster.device} and no CUDA device is visible"
        )
        return [
            CheckResult(
                "gpu",
                Status.SKIP,
                f"{why}: this node trains on CPU, so the GPU checks (count, NVML, matmul, "
                "memory, all-reduce) are skipped",
            )
        ]
    import torch

    visible = torch.cuda.device_count()
    count = check_count(cfg, visible)
    if count.status is Status.FAIL:
        return [count]
    lines = run_probe(list(range(slots)), cfg.health)
    return [count, *judge_nvml(lines, cfg.health), *judge_probes(lines, slots)]


def check_count(cfg: Config, visible: int) -> CheckResult:
    expected = cfg.health.expected_gpus or cfg.cluster.workers_per_node
    key = "health.expected_gpus" if cfg.health.expected_gpus else "cluster.workers_per_node"
    if expected and visible < expected:
        return CheckResult(
            "gpu_count",
            Status.FAIL,
            f"{visible} GPU(s) visible, {key}={expected} expected. Fix: check nvidia-smi "
            "(a GPU that fell off the bus needs a reset or a reboot) and CUDA_VISIBLE_DEVICES, "
            f"or lower {key}",
        )
    if visible == 0:
        return CheckResult(
            "gpu_count",
            Status.FAIL,
            "cluster.device=cuda but no GPU is visible. Fix: check the driver (nvidia-smi) "
            "and CUDA_VISIBLE_DEVICES, or use cluster.device=auto",
        )
    wanted = f" ({key}={expected})" if expected else ""
    return CheckResult("gpu_count", Status.PASS, f"{visible} GPU(s) visible{wanted}")


# --- the probe child, from the parent ---------------------------------------------------------


def run_probe(devices: list[int], cfg: HealthConfig) -> list[dict[str, Any]]:
    """Run the probe child for ``devices``, and return its JSON lines.

    They end with a ``timeout`` or ``crashed`` line if it did not finish."""
    cmd = [
        sys.executable,
        "-m",
        "launcher.health.gpu_probe",
        "--devices",
        ",".join(map(str, devices)),
        "--memory-fraction",
        str(cfg.gpu_memory_fraction),
    ]
    # stderr to a file, not a pipe: a chatty driver must not fill a pipe and stall the child.
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=errors, stdin=subprocess.DEVNULL
        )
        lines = _read_lines(proc, cfg.gpu_probe_timeout_s)
        if lines and lines[-1]["kind"] == "timeout":
            return lines
        code = proc.wait()
        if code != 0:
            errors.seek(0)
            last = lines[-1] if lines else {}
            tail = errors.read()[-2000:]
            lines.append({"kind": "crashed", "code": code, "stderr": tail, "last": last})
    return lines


def _read_lines(proc: subprocess.Popen[bytes], timeout_s: float) -> list[dict[str, Any]]:
    """The child's JSON lines until it closes stdout.

    The child is killed, with a last ``timeout`` line, when ``timeout_s`` runs out first. Raw
    reads: a buffered reader could hold a line that ``select`` no longer reports."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    lines: list[dict[str, Any]] = []
    pending = b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                proc.kill()
                proc.wait()
                last = lines[-1] if lines else {}
                lines.append({"kind": "timeout", "after_s": timeout_s, "last": last})
                return lines
            chunk = os.read(fd, 65536)
            *complete, pending = (pending + chunk).split(b"\n")
            lines.extend(json.loads(line) for line in complete if line.strip())
            if not chunk:
                return lines


# --- judging the readings (pure) --------------------------------------------------------------


def judge_nvml(lines: list[dict[str, Any]], cfg: HealthConfig) -> list[CheckResult]:
    """ECC, damaged memory, temperature and slowdown rows from the NVML readings."""
    readings = [x for x in lines if x["kind"] == "nvml"]
    error = next((x["error"] for x in readings if "error" in x), None)
    if error is not None:
        return [_nvml_unavailable(error)]
    if not readings:
        return []
    return [
        _ecc_row(readings),
        _memory_health_row(readings),
        _temperature_row(readings, cfg),
        _throttle_row(readings, cfg),
    ]


def _nvml_unavailable(error: str) -> CheckResult:
    """The warning row when NVML could not be read (not installed, or did not start)."""
    fix = (
        "pip install 'elastic-runtime[gpu]'"
        if "not installed" in error
        else "check the driver (nvidia-smi)"
    )
    return CheckResult("gpu_nvml", Status.WARN, f"{error}: NVML checks skipped. Fix: {fix}")


def _ecc_row(readings: list[dict[str, Any]]) -> CheckResult:
    """Fails on any uncorrected ECC error since the GPU's last reset."""
    ecc = [
        f"GPU {r['device']}: {r['ecc_uncorrected']} uncorrected"
        for r in readings
        if r["ecc_uncorrected"]
    ]
    if ecc:
        return CheckResult(
            "gpu_ecc",
            Status.FAIL,
            f"uncorrected ECC errors since the last reset ({'; '.join(ecc)}). Fix: drain the "
            "node, reset the GPU (nvidia-smi -r) and replace it if they come back",
        )
    return CheckResult(
        "gpu_ecc", Status.PASS, f"no uncorrected ECC errors on {len(readings)} GPU(s)"
    )


def _memory_health_row(readings: list[dict[str, Any]]) -> CheckResult:
    """The ``gpu_memory_health`` row: fails on a retirement or row remapping pending or failed.

    It warns on rows already remapped, since the spare rows run out."""
    damaged = [
        f"GPU {r['device']}: {what}"
        for r in readings
        for what, bad in (
            ("pages pending retirement", r["retired_pending"]),
            ("row remapping pending", r["remap_pending"]),
            ("row remapping failed", r["remap_failed"]),
        )
        if bad
    ]
    remapped = [
        f"GPU {r['device']}: {r['remapped_uncorrectable']} rows remapped after uncorrectable errors"
        for r in readings
        if r["remapped_uncorrectable"]
    ]
    if damaged:
        return CheckResult(
            "gpu_memory_health",
            Status.FAIL,
            f"{'; '.join(damaged)}. Fix: reset the GPU (nvidia-smi -r) to apply the pending "
            "retirement or remapping; a failed remapping means the GPU must be replaced",
        )
    if remapped:
        return CheckResult(
            "gpu_memory_health",
            Status.WARN,
            f"{'; '.join(remapped)}; spare rows are finite. Fix: plan to replace the GPU",
        )
    return CheckResult(
        "gpu_memory_health",
        Status.PASS,
        f"no retired pages or row remapping pending on {len(readings)} GPU(s)",
    )


def _temperature_row(readings: list[dict[str, Any]], cfg: HealthConfig) -> CheckResult:
    """Fails on a GPU above ``health.max_gpu_temp_c``; else names the hottest."""
    hot = [
        f"GPU {r['device']}: {r['temperature_c']} C"
        for r in readings
        if r["temperature_c"] is not None and r["temperature_c"] > cfg.max_gpu_temp_c
    ]
    if hot:
        return CheckResult(
            "gpu_temperature",
            Status.FAIL,
            f"{'; '.join(hot)}, above health.max_gpu_temp_c={cfg.max_gpu_temp_c}. Fix: check the "
            "node's cooling and fans, or raise health.max_gpu_temp_c",
        )
    temps = [r["temperature_c"] for r in readings if r["temperature_c"] is not None]
    hottest = f"hottest {max(temps)} C" if temps else "temperature not reported"
    return CheckResult(
        "gpu_temperature",
        Status.PASS,
        f"{hottest} <= health.max_gpu_temp_c={cfg.max_gpu_temp_c}",
    )


def _throttle_row(readings: list[dict[str, Any]], cfg: HealthConfig) -> CheckResult:
    """The ``gpu_throttle`` row: a hardware slowdown of the clocks.

    It is a warning, or a failure with ``health.fail_on_throttle``."""
    slow = [
        f"GPU {r['device']}: "
        + ", ".join(v for bit, v in SLOWDOWN_REASONS.items() if r["clock_event_reasons"] & bit)
        for r in readings
        if r["clock_event_reasons"] and r["clock_event_reasons"] & sum(SLOWDOWN_REASONS)
    ]
    if slow:
        return CheckResult(
            "gpu_throttle",
            Status.FAIL if cfg.fail_on_throttle else Status.WARN,
            f"clocks slowed down ({'; '.join(slow)}): this node would set the pace of every "
            "step. Fix: check cooling and power delivery"
            + ("" if cfg.fail_on_throttle else "; health.fail_on_throttle=true keeps it out"),
        )
    return CheckResult(
        "gpu_throttle", Status.PASS, f"no hardware slowdown on {len(readings)} GPU(s)"
    )


def judge_probes(lines: list[dict[str, Any]], devices: int) -> list[CheckResult]:
    """Matmul, memory and all-reduce rows; a timeout or crash fails the stage it happened in."""
    matmuls = [x for x in lines if x["kind"] == "matmul"]
    memories = [x for x in lines if x["kind"] == "memory"]
    allreduce = next((x for x in lines if x["kind"] == "allreduce"), None)
    end = next((x for x in lines if x["kind"] in ("timeout", "crashed")), None)
    rows = [
        _matmul_row(matmuls, devices),
        _memory_row(memories, devices),
        _allreduce_row(allreduce, devices, finished=end is None),
        None if end is None else _probe_end_row(end),
    ]
    return [row for row in rows if row is not None]


def _matmul_row(matmuls: list[dict[str, Any]], devices: int) -> CheckResult | None:
    """The ``gpu_matmul`` row: fails on a wrong result, passes once all devices' matmuls came back.

    Otherwise None: the probe ended before, which its own row says."""
    bad = [
        f"GPU {m['device']}: fp32 relative error {m['fp32_rel_error']:.1e}, "
        f"{m['fp16_mismatched']} wrong fp16 elements"
        for m in matmuls
        if m["fp32_rel_error"] > FP32_TOLERANCE or m["fp16_mismatched"]
    ]
    if bad:
        return CheckResult(
            "gpu_matmul",
            Status.FAIL,
            f"wrong results ({'; '.join(bad)}): silent data corruption. Fix: drain the "
            "node and test the GPU (dcgmi diag -r 3)",
        )
    if len(matmuls) != devices:
        return None
    speeds = ", ".join(f"{m['fp16_tflops']:.0f}" for m in matmuls)
    return CheckResult(
        "gpu_matmul",
        Status.PASS,
        f"fp32 and fp16 {MATMUL_N}^3 results right on {devices} GPU(s); fp16 TFLOPS {speeds}",
    )


def _memory_row(memories: list[dict[str, Any]], devices: int) -> CheckResult | None:
    """Fails on memory read back wrong; passes once every device's probe came back; else None."""
    wrong = [f"GPU {m['device']}: {m['wrong']} bytes" for m in memories if m["wrong"]]
    if wrong:
        return CheckResult(
            "gpu_memory",
            Status.FAIL,
            f"memory read back wrong ({'; '.join(wrong)}). Fix: drain the node and test "
            "the GPU (dcgmi diag -r 3)",
        )
    if len(memories) != devices:
        return None
    gib = ", ".join(f"{m['bytes'] / GIB:.1f}/{m['total'] / GIB:.1f}" for m in memories)
    return CheckResult("gpu_memory", Status.PASS, f"allocated, wrote and read back GiB {gib}")


def _allreduce_row(
    allreduce: dict[str, Any] | None, devices: int, finished: bool
) -> CheckResult | None:
    """The all-reduce's outcome; a skip for one GPU when the probe finished; else None."""
    if allreduce is None:
        if devices == 1 and finished:
            return CheckResult("gpu_allreduce", Status.SKIP, "one GPU: nothing to all-reduce")
        return None
    if allreduce["wrong"]:
        return CheckResult(
            "gpu_allreduce",
            Status.FAIL,
            f"NCCL all-reduce over {devices} GPUs gave {allreduce['wrong']} wrong elements. "
            "Fix: check the NVLink/PCIe topology (nvidia-smi topo -m, nvidia-smi nvlink -s)",
        )
    return CheckResult(
        "gpu_allreduce",
        Status.PASS,
        f"NCCL all-reduce over {devices} GPUs correct, {allreduce['bus_gbps']:.0f} GB/s "
        "bus bandwidth",
    )


def _probe_end_row(end: dict[str, Any]) -> CheckResult:
    """The failure of a probe child that timed out or crashed, naming the stage it was in."""
    last = end.get("last", {})
    where = (
        f" during the {last['stage']} probe"
        + (f" of GPU {last['device']}" if "device" in last else "")
        if last.get("kind") == "stage"
        else ""
    )
    if end["kind"] == "timeout":
        message = (
            f"the GPU probes did not finish in health.gpu_probe_timeout_s="
            f"{end['after_s']:.0f}{where}: a hung GPU or driver. Fix: check nvidia-smi and "
            "dmesg for Xid errors, reset the GPU, or raise health.gpu_probe_timeout_s"
        )
    else:
        tail = end["stderr"].strip().splitlines()[-1:] or ["no output"]
        message = (
            f"the GPU probes crashed (exit code {end['code']}){where}: {tail[0]}. Fix: "
            "check nvidia-smi and dmesg for Xid errors"
        )
    return CheckResult("gpu_probe", Status.FAIL, message)
