"""GPU health while training: the verdicts on recorded NVML answers, the NVML layer against a
replayed nvidia-ml-py, and a watch that stays off (and says why) where it cannot run.

None of it needs a GPU or nvidia-ml-py: the judging is pure, and the NVML layer and the thread
are driven by :class:`FakeNvml`, which answers as nvidia-ml-py does on an H100 (page retirement
is NotSupported there: Hopper remaps rows instead).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from elastic import event_types as ev
from elastic.config import HealthConfig
from elastic.events import EventLog, read_events
from launcher.health.gpu_watch import GpuWatch, Reading, WatchVerdict, judge_watch, read_devices

CFG = HealthConfig()
# A healthy H100 under load, as read_devices builds it from nvidia-ml-py's answers: no
# uncorrectable errors since the driver loaded, no rows remapped, page retirement NotSupported,
# clocks held only by the software power cap (0x04, not a slowdown).
HEALTHY = Reading(
    index=3,
    ecc_uncorrected=0,
    retired_pending=None,
    remap_pending=False,
    remap_failed=False,
    clock_event_reasons=0x04,
)
NOT_SUPPORTED = Reading(index=3)  # a GPU (GeForce, or a vGPU) that reports none of it


def with_(**changes: Any) -> Reading:
    return Reading(**{**HEALTHY.__dict__, **changes})


def test_a_healthy_gpu_gives_no_verdict_on_the_first_poll_or_after() -> None:
    assert judge_watch(None, HEALTHY, CFG) == WatchVerdict()
    assert judge_watch(HEALTHY, HEALTHY, CFG) == WatchVerdict()


def test_uncorrectable_ecc_errors_that_grow_are_fatal_and_old_ones_set_the_baseline() -> None:
    assert judge_watch(None, with_(ecc_uncorrected=2), CFG) == WatchVerdict()
    verdict = judge_watch(with_(ecc_uncorrected=2), with_(ecc_uncorrected=5), CFG)
    assert verdict.fatal == ("GPU 3: uncorrectable ECC errors rose from 2 to 5 while training",)
    assert verdict.warnings == ()


def test_rows_pending_remapping_and_a_failed_remap_are_fatal() -> None:
    pending = judge_watch(HEALTHY, with_(remap_pending=True), CFG)
    assert len(pending.fatal) == 1
    assert pending.fatal[0].startswith("GPU 3: rows pending remapping")
    failed = judge_watch(HEALTHY, with_(remap_pending=True, remap_failed=True), CFG)
    assert [f.split(";")[0] for f in failed.fatal] == [
        "GPU 3: rows pending remapping",
        "GPU 3: row remapping failed",
    ]
    retired = judge_watch(None, with_(retired_pending=True), CFG)  # a V100's page retirement
    assert retired.fatal[0].startswith("GPU 3: pages pending retirement")


def test_xid_79_fell_off_the_bus_is_fatal() -> None:
    verdict = judge_watch(HEALTHY, with_(xids=(79,)), CFG)
    assert verdict.fatal == ("GPU 3: XID 79 (GPU has fallen off the bus) while training",)


def test_an_xid_missing_from_the_list_is_fatal_too() -> None:
    verdict = judge_watch(HEALTHY, with_(xids=(119,)), CFG)  # GSP RPC timeout
    assert verdict.fatal == ("GPU 3: XID 119 (see NVIDIA's XID catalog) while training",)


@pytest.mark.parametrize("xid", [13, 31, 43, 45])
def test_application_xids_only_warn(xid: int) -> None:
    verdict = judge_watch(HEALTHY, with_(xids=(xid,)), CFG)
    assert verdict.fatal == ()
    assert len(verdict.warnings) == 1
    assert verdict.warnings[0].startswith(f"GPU 3: XID {xid} (")
    assert "application error" in verdict.warnings[0]


def test_thermal_throttle_that_starts_warns_once() -> None:
    hot = with_(clock_event_reasons=0x04 | 0x40)  # power cap, then hardware thermal slowdown
    verdict = judge_watch(HEALTHY, hot, CFG)
    assert verdict.fatal == ()
    assert verdict.warnings == (
        "GPU 3: clocks slowed down while training (hardware thermal slowdown); this node sets "
        "the pace of every step. Fix: check cooling and power delivery",
    )
    assert judge_watch(hot, hot, CFG) == WatchVerdict()  # still throttling: nothing new


def test_throttling_is_fatal_with_fail_on_throttle() -> None:
    verdict = judge_watch(
        HEALTHY, with_(clock_event_reasons=0x20), HealthConfig(fail_on_throttle=True)
    )
    assert len(verdict.fatal) == 1 and "software thermal slowdown" in verdict.fatal[0]


def test_not_supported_readings_give_no_verdict() -> None:
    assert judge_watch(None, NOT_SUPPORTED, CFG) == WatchVerdict()
    assert judge_watch(NOT_SUPPORTED, NOT_SUPPORTED, CFG) == WatchVerdict()
    assert judge_watch(HEALTHY, NOT_SUPPORTED, CFG) == WatchVerdict()


def test_a_failed_nvml_call_warns_when_it_starts_failing_and_is_never_fatal() -> None:
    broken = with_(ecc_uncorrected=None, failed=("nvmlDeviceGetTotalEccErrors: Unknown Error",))
    verdict = judge_watch(with_(ecc_uncorrected=7), broken, CFG)
    assert verdict == WatchVerdict(
        warnings=(
            "GPU 3: NVML could not read nvmlDeviceGetTotalEccErrors: Unknown Error; that check "
            "is skipped",
        )
    )
    assert judge_watch(broken, broken, CFG) == WatchVerdict()


# --- the NVML layer and the thread, against a replayed nvidia-ml-py ---------------------------


class FakeNvml:
    """nvidia-ml-py's calls that the watch makes, answering from ``answers`` (call name ->
    value, or an error code to raise) for GPU ``index``; ``xids`` are queued XID events."""

    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_TIMEOUT = 10
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 0x8

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__({3: "Not Supported", 10: "Timeout"}.get(value, "Unknown Error"))
            self.value = value

    def __init__(self, answers: dict[str, Any], xids: list[int], index: int = 3) -> None:
        self.answers, self.xids, self.index = answers, xids, index
        self.shutdown = threading.Event()
        self.waits: list[int] = []

    def __getattr__(self, call: str) -> Any:
        if call not in self.answers:
            raise AttributeError(call)
        answer = self.answers[call]

        def reply(handle: str, *args: Any) -> Any:
            if isinstance(answer, self.NVMLError):
                raise answer
            return answer

        return reply

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdown.set()

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle{index}"

    def nvmlDeviceGetIndex(self, handle: str) -> int:
        return self.index

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, handle: str, types: int, xid_set: str) -> None:
        pass

    def nvmlEventSetFree(self, xid_set: str) -> None:
        pass

    def nvmlEventSetWait_v2(self, xid_set: str, timeout_ms: int) -> Any:
        self.waits.append(timeout_ms)
        if not self.xids:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)
        return SimpleNamespace(eventType=0x8, eventData=self.xids.pop(0), device="handle0")


H100_ANSWERS: dict[str, Any] = {
    "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
    "nvmlDeviceGetRetiredPagesPendingStatus": FakeNvml.NVMLError(3),
    "nvmlDeviceGetTotalEccErrors": 0,
    "nvmlDeviceGetCurrentClocksEventReasons": 0x04,
}


def test_read_devices_turns_nvml_answers_into_readings() -> None:
    nvml = FakeNvml(H100_ANSWERS, xids=[79])
    readings = read_devices(nvml, {3: "handle0"}, {3: "set"})
    assert readings == [with_(xids=(79,))]
    assert all(0 < ms <= 100 for ms in nvml.waits)  # bounded XID waits
    broken = FakeNvml({**H100_ANSWERS, "nvmlDeviceGetTotalEccErrors": FakeNvml.NVMLError(999)}, [])
    assert read_devices(broken, {3: "handle0"}, {}) == [
        with_(ecc_uncorrected=None, failed=("nvmlDeviceGetTotalEccErrors: Unknown Error",))
    ]


def test_a_fatal_xid_is_an_event_and_one_call_of_on_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = FakeNvml(H100_ANSWERS, xids=[13, 79])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    called: list[str] = []
    log = EventLog(tmp_path, "n0", role="agent")
    watch = GpuWatch(HealthConfig(gpu_watch_s=0.01), "cuda", log, called.append)
    watch.start()
    assert nvml.shutdown.wait(10)  # the watch ends after a fatal verdict and releases NVML
    watch.close()
    assert called == ["GPU 3: XID 79 (GPU has fallen off the bus) while training"]
    events = read_events(tmp_path)
    assert [e["event"] for e in events] == ["gpu_warning", "gpu_fault"]
    assert events[0]["gpu"] == 3 and "XID 13" in events[0]["reason"]
    assert events[1]["gpus"] == [3] and events[1]["reasons"] == called


def test_close_stops_a_healthy_watch_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = FakeNvml(H100_ANSWERS, xids=[])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    watch = GpuWatch(HealthConfig(gpu_watch_s=3600), "cuda", EventLog(tmp_path, "n0"), print)
    watch.start()
    watch.close()
    assert nvml.shutdown.is_set()
    assert read_events(tmp_path) == []


def off_events(tmp_path: Path, cfg: HealthConfig, device: str) -> list[dict[str, Any]]:
    """The events of a watch started and closed on ``device``; no thread may be left."""
    before = set(threading.enumerate())
    watch = GpuWatch(cfg, device, EventLog(tmp_path, "n0", role="agent"), print)
    watch.start()
    assert set(threading.enumerate()) == before
    watch.close()
    return read_events(tmp_path)


def test_a_cpu_node_starts_no_thread_and_says_the_watch_is_off(tmp_path: Path) -> None:
    events = off_events(tmp_path, CFG, "cpu")
    assert [e["event"] for e in events] == ["gpu_watch_off"]
    assert events[0]["reason"] == "this node trains on CPU"
    assert ev.GPU_WATCH_OFF.of(events) == events


def test_without_nvidia_ml_py_the_watch_is_off_and_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    events = off_events(tmp_path, CFG, "cuda")
    assert [e["reason"] for e in events] == [
        "nvidia-ml-py is not installed. Fix: pip install 'elastic-runtime[gpu]'"
    ]


def test_gpu_watch_s_0_turns_it_off(tmp_path: Path) -> None:
    events = off_events(tmp_path, HealthConfig(gpu_watch_s=0), "cuda")
    assert [e["reason"] for e in events] == [
        "health.gpu_watch_s=0. Fix: set health.gpu_watch_s=5 to turn it on"
    ]
