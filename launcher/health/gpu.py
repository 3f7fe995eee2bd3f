"""The GPU checks: the devices are there, NVML sees no damage, and each one computes.

Everything that touches a GPU runs in a child process (``python -m launcher.health.gpu``) under
``health.gpu_probe_timeout_s``: the agent never creates a CUDA context (it would hold memory on
every GPU for the whole job), and a hung GPU fails the check instead of hanging the agent. The
child prints one JSON line per reading or probe as it goes, so a timeout still tells which device
and stage hung; the readings are judged here, in the agent, by pure functions. CPU-only nodes
skip all of it and say so, and never import torch or nvidia-ml-py for it. The probes, in order,
are :func:`probe_main`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from elastic.config import Config, HealthConfig
from launcher.health.node_report import CheckResult, Status

# NVML clock event reasons (nvmlClocksEventReason*) that mean the hardware is slowing itself
# down; power capping and idle are normal and are not listed.
SLOWDOWN_REASONS = {
    0x08: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
MATMUL_N = 2048
# fp32 rounding over K = 2048 terms stays near 1e-6 relative; TF32 or corrupted data is far above.
FP32_TOLERANCE = 1e-4
GIB = 1 << 30
ALLREDUCE_ELEMENTS = 16 << 20  # 64 MB of fp32 per GPU


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


# --- the child process ------------------------------------------------------------------------


def run_probe(devices: list[int], cfg: HealthConfig) -> list[dict[str, Any]]:
    """Run the probe child for ``devices``; its JSON lines, ending with a ``timeout`` or
    ``crashed`` line if it did not finish."""
    cmd = [
        sys.executable,
        "-m",
        "launcher.health.gpu",
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
    """The child's JSON lines until it closes stdout; killed, with a last ``timeout`` line,
    when ``timeout_s`` runs out first. Raw reads: a buffered reader could hold a line that
    ``select`` no longer reports."""
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


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _nvml_readings(devices: list[int]) -> Iterator[dict[str, Any]]:
    """One reading per device; fields the GPU does not support are None."""
    try:
        import pynvml
    except ImportError:
        yield {"kind": "nvml", "error": "nvidia-ml-py is not installed"}
        return
    import torch

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        yield {"kind": "nvml", "error": f"NVML did not start: {exc}"}
        return

    def read(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except pynvml.NVMLError:
            return None  # not supported on this GPU (or by this driver)

    try:
        for index in devices:
            handle = _nvml_handle(pynvml, torch.cuda.get_device_properties(index))
            if handle is None:
                yield {"kind": "nvml", "error": f"NVML does not know CUDA device {index}"}
                return
            remap = read(pynvml.nvmlDeviceGetRemappedRows, handle)
            reasons_fn = getattr(
                pynvml,
                "nvmlDeviceGetCurrentClocksEventReasons",
                pynvml.nvmlDeviceGetCurrentClocksThrottleReasons,
            )
            yield {
                "kind": "nvml",
                "device": index,
                "name": read(pynvml.nvmlDeviceGetName, handle),
                "ecc_uncorrected": read(
                    pynvml.nvmlDeviceGetTotalEccErrors,
                    handle,
                    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    pynvml.NVML_VOLATILE_ECC,
                ),
                "retired_pending": read(pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle),
                "remapped_uncorrectable": remap[1] if remap else None,
                "remap_pending": bool(remap[2]) if remap else None,
                "remap_failed": bool(remap[3]) if remap else None,
                "temperature_c": read(
                    pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
                ),
                "clock_event_reasons": read(reasons_fn, handle),
            }
    finally:
        pynvml.nvmlShutdown()


def _nvml_handle(pynvml: Any, props: Any) -> Any:
    """NVML's handle for a CUDA device. CUDA and NVML number devices differently (under
    CUDA_VISIBLE_DEVICES, and CUDA puts the fastest first), so match by UUID, else PCI address."""
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{props.uuid}")
    except pynvml.NVMLError:
        pass
    address = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    try:
        return pynvml.nvmlDeviceGetHandleByPciBusId(address)
    except pynvml.NVMLError:
        return None


@dataclass(frozen=True)
class MatmulCase:
    """Inputs and known results on the CPU, computed once for all devices."""

    a: Any  # float64, normal
    b: Any
    ab: Any  # a @ b in float64
    ai: Any  # float16 entries in {-1, 0, 1}
    bi: Any
    aibi: Any  # ai @ bi, exact

    @classmethod
    def make(cls) -> MatmulCase:
        import torch

        gen = torch.Generator().manual_seed(0)
        a = torch.randn(MATMUL_N, MATMUL_N, generator=gen, dtype=torch.float64)
        b = torch.randn(MATMUL_N, MATMUL_N, generator=gen, dtype=torch.float64)
        # Entries in {-1, 0, 1} and K = 2048: every partial sum is an integer of at most 2048,
        # exact in fp16 and fp32 (and float64 here) whatever the accumulation order, so the
        # result is known to the bit.
        ai = torch.randint(-1, 2, (MATMUL_N, MATMUL_N), generator=gen, dtype=torch.float64)
        bi = torch.randint(-1, 2, (MATMUL_N, MATMUL_N), generator=gen, dtype=torch.float64)
        return cls(a, b, a @ b, ai.half(), bi.half(), (ai @ bi).half())


def _matmul(index: int, case: MatmulCase) -> dict[str, Any]:
    """fp32 against the float64 reference (TF32 off), and fp16 on tensor cores with the exact
    integer case; the fp16 time gives a throughput figure."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    dev = torch.device("cuda", index)
    got = (case.a.float().to(dev) @ case.b.float().to(dev)).double().cpu()
    rel_error = float((got - case.ab).norm() / case.ab.norm())
    ah, bh = case.ai.to(dev), case.bi.to(dev)
    half = ah @ bh
    torch.cuda.synchronize(dev)
    start = time.perf_counter()
    for _ in range(10):
        half = ah @ bh
    torch.cuda.synchronize(dev)
    seconds = (time.perf_counter() - start) / 10
    mismatched = int((half.cpu() != case.aibi).sum())
    return {
        "kind": "matmul",
        "device": index,
        "fp32_rel_error": rel_error,
        "fp16_mismatched": mismatched,
        "fp16_tflops": 2 * MATMUL_N**3 / seconds / 1e12,
    }


def _memory(index: int, fraction: float) -> dict[str, Any]:
    """Allocate ``fraction`` of the free memory, fill it with a pattern and count it back."""
    import torch

    free, total = torch.cuda.mem_get_info(index)
    size = int(free * fraction)
    block = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", index))
    block.fill_(0xA5)
    # Compared in slices: a comparison of the whole block would need as much memory again.
    wrong = sum(int((part != 0xA5).sum()) for part in block.split(256 << 20))
    del block
    torch.cuda.empty_cache()
    return {"kind": "memory", "device": index, "bytes": size, "total": total, "wrong": wrong}


def _allreduce(devices: list[int]) -> dict[str, Any]:
    """One NCCL all-reduce over all the node's GPUs from this process: rank i adds i + 1."""
    import torch
    import torch.cuda.nccl as nccl

    tensors = [
        torch.full((ALLREDUCE_ELEMENTS,), float(i + 1), device=torch.device("cuda", d))
        for i, d in enumerate(devices)
    ]
    nccl.all_reduce(tensors)  # warm-up: creates the communicators
    for i, t in enumerate(tensors):
        t.fill_(float(i + 1))
    for d in devices:
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    nccl.all_reduce(tensors)
    for d in devices:
        torch.cuda.synchronize(d)
    seconds = time.perf_counter() - start
    n = len(devices)
    expected = n * (n + 1) / 2
    wrong = sum(int((t != expected).sum()) for t in tensors)
    size = ALLREDUCE_ELEMENTS * 4
    return {
        "kind": "allreduce",
        "devices": n,
        "wrong": wrong,
        "bus_gbps": 2 * (n - 1) / n * size / seconds / 1e9,
    }


def probe_main(argv: list[str] | None = None) -> int:
    """The child's probes, in order: NVML readings through nvidia-ml-py (uncorrected ECC errors,
    retired pages pending, row remapping, temperature, clock slowdown reasons); per device,
    matmuls with a known result (fp32 against a float64 reference, fp16 on tensor cores with
    integer inputs, whose result is exact); a memory probe (allocate a share of the free memory,
    write, read back); an all-reduce across the node's GPUs through NCCL."""
    parser = argparse.ArgumentParser(description="GPU probes; JSON lines on stdout.")
    parser.add_argument("--devices", required=True, help="comma-separated CUDA indices")
    parser.add_argument("--memory-fraction", type=float, default=0.9)
    args = parser.parse_args(argv)
    devices = [int(d) for d in args.devices.split(",")]
    _emit(kind="stage", stage="nvml")
    for reading in _nvml_readings(devices):
        _emit(**reading)
    import torch

    _emit(kind="stage", stage="cuda_init")
    torch.cuda.init()  # no driver or a GPU off the bus: fail here, before any CPU work
    case = MatmulCase.make()
    for d in devices:
        _emit(kind="stage", stage="matmul", device=d)
        _emit(**_matmul(d, case))
        _emit(kind="stage", stage="memory", device=d)
        _emit(**_memory(d, args.memory_fraction))
    if len(devices) > 1:
        _emit(kind="stage", stage="allreduce", devices=len(devices))
        _emit(**_allreduce(devices))
    return 0


# --- judging the readings (pure) --------------------------------------------------------------


def judge_nvml(lines: list[dict[str, Any]], cfg: HealthConfig) -> list[CheckResult]:
    """ECC, damaged memory, temperature and slowdown rows from the NVML readings."""
    readings = [x for x in lines if x["kind"] == "nvml"]
    error = next((x["error"] for x in readings if "error" in x), None)
    if error is not None:
        fix = (
            "pip install 'elastic-runtime[gpu]'"
            if "not installed" in error
            else "check the driver (nvidia-smi)"
        )
        return [CheckResult("gpu_nvml", Status.WARN, f"{error}: NVML checks skipped. Fix: {fix}")]
    if not readings:
        return []
    n = len(readings)

    def devs(items: list[str]) -> str:
        return "; ".join(items)

    ecc = [
        f"GPU {r['device']}: {r['ecc_uncorrected']} uncorrected"
        for r in readings
        if r["ecc_uncorrected"]
    ]
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
    hot = [
        f"GPU {r['device']}: {r['temperature_c']} C"
        for r in readings
        if r["temperature_c"] is not None and r["temperature_c"] > cfg.max_gpu_temp_c
    ]
    slow = [
        f"GPU {r['device']}: "
        + ", ".join(v for bit, v in SLOWDOWN_REASONS.items() if r["clock_event_reasons"] & bit)
        for r in readings
        if r["clock_event_reasons"] and r["clock_event_reasons"] & sum(SLOWDOWN_REASONS)
    ]
    temps = [r["temperature_c"] for r in readings if r["temperature_c"] is not None]
    results = [
        CheckResult(
            "gpu_ecc",
            Status.FAIL,
            f"uncorrected ECC errors since the last reset ({devs(ecc)}). Fix: drain the node, "
            "reset the GPU (nvidia-smi -r) and replace it if they come back",
        )
        if ecc
        else CheckResult("gpu_ecc", Status.PASS, f"no uncorrected ECC errors on {n} GPU(s)"),
    ]
    if damaged:
        results.append(
            CheckResult(
                "gpu_memory_health",
                Status.FAIL,
                f"{devs(damaged)}. Fix: reset the GPU (nvidia-smi -r) to apply the pending "
                "retirement or remapping; a failed remapping means the GPU must be replaced",
            )
        )
    elif remapped:
        results.append(
            CheckResult(
                "gpu_memory_health",
                Status.WARN,
                f"{devs(remapped)}; spare rows are finite. Fix: plan to replace the GPU",
            )
        )
    else:
        results.append(
            CheckResult(
                "gpu_memory_health",
                Status.PASS,
                f"no retired pages or row remapping pending on {n} GPU(s)",
            )
        )
    if hot:
        results.append(
            CheckResult(
                "gpu_temperature",
                Status.FAIL,
                f"{devs(hot)}, above health.max_gpu_temp_c={cfg.max_gpu_temp_c}. Fix: check the "
                "node's cooling and fans, or raise health.max_gpu_temp_c",
            )
        )
    else:
        hottest = f"hottest {max(temps)} C" if temps else "temperature not reported"
        results.append(
            CheckResult(
                "gpu_temperature",
                Status.PASS,
                f"{hottest} <= health.max_gpu_temp_c={cfg.max_gpu_temp_c}",
            )
        )
    if slow:
        results.append(
            CheckResult(
                "gpu_throttle",
                Status.FAIL if cfg.fail_on_throttle else Status.WARN,
                f"clocks slowed down ({devs(slow)}): this node would set the pace of every "
                "step. Fix: check cooling and power delivery"
                + ("" if cfg.fail_on_throttle else "; health.fail_on_throttle=true keeps it out"),
            )
        )
    else:
        results.append(
            CheckResult("gpu_throttle", Status.PASS, f"no hardware slowdown on {n} GPU(s)")
        )
    return results


def judge_probes(lines: list[dict[str, Any]], devices: int) -> list[CheckResult]:
    """Matmul, memory and all-reduce rows; a timeout or crash fails the stage it happened in."""
    results: list[CheckResult] = []
    matmuls = [x for x in lines if x["kind"] == "matmul"]
    memories = [x for x in lines if x["kind"] == "memory"]
    allreduce = next((x for x in lines if x["kind"] == "allreduce"), None)
    end = next((x for x in lines if x["kind"] in ("timeout", "crashed")), None)

    bad = [
        f"GPU {m['device']}: fp32 relative error {m['fp32_rel_error']:.1e}, "
        f"{m['fp16_mismatched']} wrong fp16 elements"
        for m in matmuls
        if m["fp32_rel_error"] > FP32_TOLERANCE or m["fp16_mismatched"]
    ]
    if bad:
        results.append(
            CheckResult(
                "gpu_matmul",
                Status.FAIL,
                f"wrong results ({'; '.join(bad)}): silent data corruption. Fix: drain the "
                "node and test the GPU (dcgmi diag -r 3)",
            )
        )
    elif len(matmuls) == devices:
        speeds = ", ".join(f"{m['fp16_tflops']:.0f}" for m in matmuls)
        results.append(
            CheckResult(
                "gpu_matmul",
                Status.PASS,
                f"fp32 and fp16 {MATMUL_N}^3 results right on {devices} GPU(s); fp16 TFLOPS "
                f"{speeds}",
            )
        )
    wrong = [f"GPU {m['device']}: {m['wrong']} bytes" for m in memories if m["wrong"]]
    if wrong:
        results.append(
            CheckResult(
                "gpu_memory",
                Status.FAIL,
                f"memory read back wrong ({'; '.join(wrong)}). Fix: drain the node and test "
                "the GPU (dcgmi diag -r 3)",
            )
        )
    elif len(memories) == devices:
        gib = ", ".join(f"{m['bytes'] / GIB:.1f}/{m['total'] / GIB:.1f}" for m in memories)
        results.append(
            CheckResult("gpu_memory", Status.PASS, f"allocated, wrote and read back GiB {gib}")
        )
    if allreduce is not None:
        results.append(
            CheckResult(
                "gpu_allreduce",
                Status.FAIL,
                f"NCCL all-reduce over {devices} GPUs gave {allreduce['wrong']} wrong elements. "
                "Fix: check the NVLink/PCIe topology (nvidia-smi topo -m, nvidia-smi nvlink -s)",
            )
            if allreduce["wrong"]
            else CheckResult(
                "gpu_allreduce",
                Status.PASS,
                f"NCCL all-reduce over {devices} GPUs correct, {allreduce['bus_gbps']:.0f} GB/s "
                "bus bandwidth",
            )
        )
    elif devices == 1 and end is None:
        results.append(CheckResult("gpu_allreduce", Status.SKIP, "one GPU: nothing to all-reduce"))
    if end is not None:
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
        results.append(CheckResult("gpu_probe", Status.FAIL, message))
    return results


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    sys.exit(probe_main())
