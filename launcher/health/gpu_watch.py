"""GPU health while training: the agent polls NVML in a background thread on GPU nodes.

The checks before a join (:mod:`launcher.health.gpu`) cannot see a GPU that breaks an hour into
the job: an XID, uncorrectable ECC errors, memory waiting for retirement or remapping. Such a GPU
hangs or corrupts the next collective, so every ``health.gpu_watch_s`` seconds the watch reads
each GPU the node's workers may use and :func:`judge_watch` compares the reading with the one
before. A fatal verdict calls ``on_fatal`` once, so that the agent can leave as planned and
quarantine the node before the hang; throttling, application XIDs and NVML calls that fail only
warn. The judging is pure, over :class:`Reading`; :func:`read_devices` is the thin NVML layer.
Only NVML is used: the agent never creates a CUDA context, so this module never imports torch.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from logging import ERROR, WARNING
from typing import Any

from elastic import event_types as ev
from elastic.config import HealthConfig
from elastic.events import EventLog
from launcher.health.gpu import SLOWDOWN_REASONS

# NVIDIA's XID catalog (https://docs.nvidia.com/deploy/xid-errors/, "XID Error Listing"): these
# are caused by the application (a faulting kernel, an illegal address) and say nothing about
# the GPU, so they only warn; the worker's own failure is counted where it crashes.
APPLICATION_XIDS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
}
# A retirement or remapping that was recorded works after the next reset: a warning (a pending
# one is fatal below, from its own reading).
RECORDED_XIDS = {63: "ECC page retirement or row remapping recorded"}
# Every other critical XID is fatal; the catalog's names of the usual ones, for the messages.
FATAL_XIDS = {
    48: "double-bit ECC error",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
}
XID_WAIT_MS = 10  # per GPU and poll: events already queued return at once


@dataclass(frozen=True)
class Reading:
    """One poll of one GPU (``index``: NVML's, as nvidia-smi numbers it).

    A value the GPU does not support, or that NVML failed to read, is None; ``failed`` names the
    calls that failed."""

    index: int
    xids: tuple[int, ...] = ()  # critical XIDs seen since the last poll
    ecc_uncorrected: int | None = None  # volatile: since the driver loaded
    retired_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    clock_event_reasons: int | None = None
    failed: tuple[str, ...] = ()  # "nvmlDeviceGetX: error"


@dataclass(frozen=True)
class WatchVerdict:
    """What a reading means: ``fatal`` reasons make the node leave, ``warnings`` are reported."""

    fatal: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def judge_watch(previous: Reading | None, current: Reading, cfg: HealthConfig) -> WatchVerdict:
    """The verdict on ``current``, against the GPU's ``previous`` reading.

    ``previous`` is None on the first poll, which only sets the baseline of counts: the checks
    before the join judged those."""
    gpu = f"GPU {current.index}"
    fatal: list[str] = []
    warnings: list[str] = []
    for xid in current.xids:
        if xid in APPLICATION_XIDS:
            warnings.append(
                f"{gpu}: XID {xid} ({APPLICATION_XIDS[xid]}), an application error: the "
                "worker's fault, not the GPU's"
            )
        elif xid in RECORDED_XIDS:
            warnings.append(f"{gpu}: XID {xid} ({RECORDED_XIDS[xid]}): reset the GPU when idle")
        else:
            what = FATAL_XIDS.get(xid, "see NVIDIA's XID catalog")
            fatal.append(f"{gpu}: XID {xid} ({what}) while training")
    before, now = (previous.ecc_uncorrected if previous else None), current.ecc_uncorrected
    if before is not None and now is not None and now > before:
        fatal.append(f"{gpu}: uncorrectable ECC errors rose from {before} to {now} while training")
    for what, bad in (
        ("pages pending retirement", current.retired_pending),
        ("rows pending remapping", current.remap_pending),
        ("row remapping failed", current.remap_failed),
    ):
        if bad:
            fatal.append(f"{gpu}: {what}; the GPU needs a reset and a test (dcgmi diag -r 3)")
    was = (previous.clock_event_reasons or 0) if previous else 0
    started = (current.clock_event_reasons or 0) & ~was
    slow = [name for bit, name in SLOWDOWN_REASONS.items() if started & bit]
    if slow:
        message = (
            f"{gpu}: clocks slowed down while training ({', '.join(slow)}); this node sets the "
            "pace of every step. Fix: check cooling and power delivery"
        )
        (fatal if cfg.fail_on_throttle else warnings).append(message)
    for failure in current.failed:
        if previous is None or failure not in previous.failed:
            warnings.append(f"{gpu}: NVML could not read {failure}; that check is skipped")
    return WatchVerdict(tuple(fatal), tuple(warnings))


def read_devices(nvml: Any, handles: dict[int, Any], xid_sets: dict[int, Any]) -> list[Reading]:
    """One :class:`Reading` per handle (NVML index -> handle), draining each GPU's XID event set.

    The event sets are ``xid_sets``; one is absent where the GPU does not report XIDs."""
    return [_read(nvml, i, handle, xid_sets.get(i)) for i, handle in handles.items()]


def _read(nvml: Any, index: int, handle: Any, xid_set: Any) -> Reading:
    """NotSupported reads as None; any other NVML error too, and is named in ``failed``."""
    failed: list[str] = []

    def read(call: str, *args: Any) -> Any:
        try:
            return getattr(nvml, call)(handle, *args)
        except nvml.NVMLError as exc:
            if exc.value != nvml.NVML_ERROR_NOT_SUPPORTED:
                failed.append(f"{call}: {exc}")
            return None

    xids: list[int] = []
    while xid_set is not None:
        try:
            xids.append(int(nvml.nvmlEventSetWait_v2(xid_set, XID_WAIT_MS).eventData))
        except nvml.NVMLError:  # NVML_ERROR_TIMEOUT: none left
            break
    remap = read("nvmlDeviceGetRemappedRows")  # (corrected, uncorrected, pending, failure)
    pending = read("nvmlDeviceGetRetiredPagesPendingStatus")
    reasons = (
        "nvmlDeviceGetCurrentClocksEventReasons"
        if hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons")
        else "nvmlDeviceGetCurrentClocksThrottleReasons"
    )
    return Reading(
        index=index,
        xids=tuple(xids),
        ecc_uncorrected=read(
            "nvmlDeviceGetTotalEccErrors",
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        ),
        retired_pending=None if pending is None else bool(pending),
        remap_pending=None if remap is None else bool(remap[2]),
        remap_failed=None if remap is None else bool(remap[3]),
        clock_event_reasons=read(reasons),
        failed=tuple(failed),
    )


class GpuWatch:
    """Polls the node's GPUs in a daemon thread from :meth:`start` until :meth:`close`.

    A fatal verdict is a ``gpu_fault`` event and one call of ``on_fatal(reason)``, and the watch
    ends."""

    def __init__(
        self, cfg: HealthConfig, device: str, events: EventLog, on_fatal: Callable[[str], None]
    ) -> None:
        self._cfg, self._device, self._events, self._on_fatal = cfg, device, events, on_fatal
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        self._xid_sets: dict[int, Any] = {}

    def start(self) -> None:
        why = self._open()
        if why is not None:
            self._events.emit(
                ev.GPU_WATCH_OFF, f"GPU health while training is off: {why}", reason=why
            )
            return
        self._thread = threading.Thread(target=self._run, name="gpu-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread at once (it waits on an event, and XID waits are bounded)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _open(self) -> str | None:
        """Start NVML and find the GPUs; why the watch is off, or None."""
        if self._device != "cuda":
            return "this node trains on CPU"
        if not self._cfg.gpu_watch_s:
            return "health.gpu_watch_s=0. Fix: set health.gpu_watch_s=5 to turn it on"
        try:
            import pynvml
        except ImportError:
            return "nvidia-ml-py is not installed. Fix: pip install 'elastic-runtime[gpu]'"
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return f"NVML did not start ({exc}). Fix: check the driver (nvidia-smi)"
        self._nvml = pynvml
        try:
            self._handles = _visible_handles(pynvml)
        except (pynvml.NVMLError, ValueError) as exc:
            self._release()
            return f"NVML cannot find the GPUs of CUDA_VISIBLE_DEVICES ({exc}). Fix: check it"
        for index, handle in self._handles.items():
            try:
                self._xid_sets[index] = pynvml.nvmlEventSetCreate()
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, self._xid_sets[index]
                )
            except pynvml.NVMLError:  # this GPU reports no XIDs; its other readings still count
                if index in self._xid_sets:
                    pynvml.nvmlEventSetFree(self._xid_sets.pop(index))
        return None

    def _run(self) -> None:
        previous: dict[int, Reading] = {}
        try:
            while not self._stop.is_set():
                faults: dict[str, int] = {}  # reason -> GPU
                for reading in read_devices(self._nvml, self._handles, self._xid_sets):
                    verdict = judge_watch(previous.get(reading.index), reading, self._cfg)
                    previous[reading.index] = reading
                    faults.update({reason: reading.index for reason in verdict.fatal})
                    for w in verdict.warnings:
                        self._events.emit(
                            ev.GPU_WARNING, w, level=WARNING, gpu=reading.index, reason=w
                        )
                if faults:
                    reason = "; ".join(faults)
                    gpus = sorted(set(faults.values()))
                    self._events.emit(
                        ev.GPU_FAULT, reason, level=ERROR, gpus=gpus, reasons=list(faults)
                    )
                    self._on_fatal(reason)
                    return
                self._stop.wait(self._cfg.gpu_watch_s)
        finally:
            self._release()

    def _release(self) -> None:
        for xid_set in self._xid_sets.values():
            self._nvml.nvmlEventSetFree(xid_set)
        self._xid_sets.clear()
        self._nvml.nvmlShutdown()


def _visible_handles(nvml: Any) -> dict[int, Any]:
    """NVML index -> handle of the GPUs CUDA_VISIBLE_DEVICES names (by index or UUID).

    With the variable unset, of every GPU. Its indices are CUDA's order, which is NVML's on a
    node of one GPU model."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible is not None else range(nvml.nvmlDeviceGetCount())
    handles = [
        nvml.nvmlDeviceGetHandleByUUID(name.strip())
        if isinstance(name, str) and name.strip().startswith("GPU-")
        else nvml.nvmlDeviceGetHandleByIndex(int(name))
        for name in names
    ]
    return {nvml.nvmlDeviceGetIndex(handle): handle for handle in handles}
