"""``python -m launcher.health.gpu_probe``: the GPU probe child, which touches the GPUs.

The agent runs it before each join (:func:`launcher.health.gpu.run_probe`) under
``health.gpu_probe_timeout_s``, so that the agent never creates a CUDA context (it would hold
memory on every GPU for the whole job) and a hung GPU fails the check instead of hanging the
agent. It prints one JSON line per stage, reading or probe as it goes, so a timeout still tells
which device and stage hung; the parent judges the lines (:mod:`launcher.health.gpu`). The probes,
in order, are :func:`main`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MATMUL_N = 2048
ALLREDUCE_ELEMENTS = 16 << 20  # 64 MB of fp32 per GPU


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
    """NVML's handle for a CUDA device, matched by UUID, else by PCI address.

    CUDA and NVML number devices differently (under CUDA_VISIBLE_DEVICES, and CUDA puts the
    fastest first), hence the match by UUID."""
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
    """Check matmuls on device ``index``: fp32 against float64, and fp16 on tensor cores.

    fp32 is compared with the float64 reference (TF32 off). fp16 runs on tensor cores with the
    exact integer case; the fp16 time gives a throughput figure."""
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


def main(argv: list[str] | None = None) -> int:
    """Run the child's probes, in order, each found as a JSON line on stdout.

    First NVML readings through nvidia-ml-py: uncorrected ECC errors, retired pages pending, row
    remapping, temperature, clock slowdown reasons. Then, per device, matmuls with a known
    result (fp32 against a float64 reference, fp16 on tensor cores with integer inputs, whose
    result is exact). Then a memory probe (allocate a share of the free memory, write, read
    back). Last, an all-reduce across the node's GPUs through NCCL."""
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


if __name__ == "__main__":
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    sys.exit(main())
