"""The event log's follower, on real files."""

from __future__ import annotations

from pathlib import Path

from elastic.events import EventFollower, EventLog


def test_a_follower_of_new_events_skips_what_earlier_runs_wrote(tmp_path: Path) -> None:
    old = EventLog(tmp_path, "node0", role="agent")
    old.emit("node_left", code=4)
    old.close()
    everything, only_new = EventFollower(tmp_path), EventFollower(tmp_path, only_new=True)
    again = EventLog(tmp_path, "node0", role="agent")
    again.emit("agent_started")
    EventLog(tmp_path, "node1", role="agent").emit("agent_started")  # a file that is new
    assert [e["event"] for e in everything.poll()] == [
        "node_left",
        "agent_started",
        "agent_started",
    ]
    assert sorted((e["node"], e["event"]) for e in only_new.poll()) == [
        ("node0", "agent_started"),
        ("node1", "agent_started"),
    ]
