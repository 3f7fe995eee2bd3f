"""The watchdog's verdict: silence, or a step that computes for too long, is a frozen worker."""

from __future__ import annotations

from launcher.agent.watchdog import Watchdog

LIMIT = 10.0


def beat(w: Watchdog, start: float, end: float, **status: object) -> None:
    """Send the same status once a second from ``start`` to ``end`` inclusive."""
    t = start
    while t <= end:
        w.heartbeat(dict(status), t)
        t += 1.0


def test_silence_beyond_the_limit_is_reported() -> None:
    w = Watchdog(LIMIT)
    w.start(100.0)
    assert w.verdict(110.0) is None
    assert w.verdict(110.5) == "no heartbeat for 10.5 s"
    w.heartbeat({"round": 1, "step": 3, "phase": "step", "waiting": True}, 111.0)
    assert w.verdict(115.0) is None
    assert w.verdict(121.5) == "no heartbeat for 10.5 s"  # waiting does not excuse silence


def test_a_step_computing_beyond_the_limit_is_reported() -> None:
    w = Watchdog(LIMIT)
    w.start(0.0)
    beat(w, 1.0, 12.0, round=1, step=5, phase="step", waiting=False)
    assert w.verdict(11.0) is None  # 10 s on step 5: not beyond the limit
    assert w.verdict(12.0) == "step 5 computing for 11.0 s"


def test_a_step_waiting_for_peers_is_not_reported() -> None:
    w = Watchdog(LIMIT)
    w.start(0.0)
    beat(w, 1.0, 30.0, round=1, step=5, phase="step", waiting=True)
    assert w.verdict(30.0) is None


def test_idle_and_checkpoint_phases_are_not_stuck() -> None:
    for phase in ("idle", "checkpoint"):
        w = Watchdog(LIMIT)
        w.start(0.0)
        beat(w, 1.0, 30.0, round=1, step=5, phase=phase, waiting=False)
        assert w.verdict(30.0) is None, phase


def test_a_changing_step_resets_the_clock() -> None:
    w = Watchdog(LIMIT)
    w.start(0.0)
    beat(w, 1.0, 7.0, round=1, step=5, phase="step", waiting=False)
    beat(w, 8.0, 15.0, round=1, step=6, phase="step", waiting=False)
    assert w.verdict(15.0) is None  # 14 s since step 5 began, 7 s on step 6
    beat(w, 16.0, 18.0, round=1, step=6, phase="step", waiting=False)
    assert w.verdict(18.0) is None  # exactly 10 s on step 6
    w.heartbeat({"round": 1, "step": 6, "phase": "step", "waiting": False}, 18.5)
    assert w.verdict(18.5) == "step 6 computing for 10.5 s"


def test_an_agent_that_was_stopped_judges_its_workers_from_when_it_woke() -> None:
    w = Watchdog(LIMIT)
    w.start(0.0)
    beat(w, 1.0, 5.0, round=1, step=5, phase="step", waiting=False)
    w.excuse(20.0)  # the agent was stopped from 5 s to 20 s; the heartbeats wait unread
    assert w.verdict(20.5) is None
    assert w.verdict(30.5) == "no heartbeat for 10.5 s"  # silent since it woke: frozen
    w.heartbeat({"round": 1, "step": 5, "phase": "step", "waiting": False}, 30.6)
    assert w.verdict(30.6) == "step 5 computing for 10.6 s"  # counted from the wake-up only
    w.excuse(3.0)  # an excuse never moves the clock back
    assert w.verdict(30.6) == "step 5 computing for 10.6 s"
