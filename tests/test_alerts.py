"""Alerts: what is alerted, pure (launcher/alerts.py, the leader's ``below_min_nodes``), and how
it is sent (launcher/notify.py): to a local HTTP server and a command the tests start, and
without ever holding up the caller when the webhook refuses, hangs or the command never ends."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from elastic import config
from elastic import event_types as ev
from elastic.config import Config, ConfigError, NotifyConfig, RendezvousConfig
from elastic.control import EXIT_UNSAVED
from elastic.events import read_events
from launcher import alerts
from launcher.alerts import AlertPolicy, reports_failure
from launcher.notify import CLEANUP_S, Notifier
from launcher.rendezvous.keys import JobKeys
from launcher.rendezvous.leader import Leadership
from launcher.rendezvous.membership import JobView, NodeRecord, Round, leader_value
from launcher.rendezvous.round_plan import short_of_nodes

# --- what is alerted ------------------------------------------------------------------------------


def event(kind: ev.EventType, node: str = "node0", ts: float = 1000.0, **fields: Any) -> dict:
    return {"ts": ts, "event": kind.name, "node": node, **fields}


def recovered() -> dict:
    return event(ev.RECOVERED, rank=0, step=40, world_size=2)


def test_a_quarantine_is_an_alert_about_the_quarantined_node_with_the_events_fields() -> None:
    policy = AlertPolicy("j1", recoveries_per_hour=10, below_min_nodes_s=60)
    reasons = ["worker crashed"] * 3
    e = event(
        ev.QUARANTINED, "node1", 1000.0, peer="node1", until=2800.0, by="agent", reasons=reasons
    )
    alert = policy.take(e, now=5.0)
    assert alert is not None and alert.kind == alerts.QUARANTINED
    assert alert.text == (
        "j1: node1 quarantined for 30 min by agent (worker crashed; worker crashed; worker crashed)"
    )
    payload = alert.payload()
    assert {k: payload[k] for k in ("kind", "job_id", "node", "ts")} == {
        "kind": "node_quarantined",
        "job_id": "j1",
        "node": "node1",
        "ts": 1000.0,
    }
    assert payload["peer"] == "node1" and payload["until"] == 2800.0 and payload["by"] == "agent"


def test_recoveries_alert_at_the_nth_within_an_hour_then_count_again() -> None:
    policy = AlertPolicy("j1", recoveries_per_hour=3, below_min_nodes_s=60)
    assert [policy.take(recovered(), t) for t in (0.0, 10.0)] == [None, None]
    third = policy.take(recovered(), 20.0)
    assert third is not None and third.kind == alerts.RECOVERIES
    assert "3 recoveries within an hour" in third.text and "step 40" in third.text
    assert [policy.take(recovered(), t) for t in (30.0, 40.0)] == [None, None]  # counted anew
    assert policy.take(recovered(), 50.0) is not None
    # Three spread over more than an hour are no news: the first has left the window.
    spread = AlertPolicy("j1", recoveries_per_hour=3, below_min_nodes_s=60)
    assert [spread.take(recovered(), t) for t in (0.0, 1800.0, 3600.0)] == [None] * 3
    assert spread.take(recovered(), 3700.0) is not None  # three within the hour before it


def test_waiting_for_nodes_alerts_only_once_it_lasted_and_no_round_formed_since() -> None:
    short = event(ev.BELOW_MIN_NODES, ready=1, min_nodes=2, round=4)
    policy = AlertPolicy("j1", recoveries_per_hour=10, below_min_nodes_s=60)
    assert policy.take(short, now=100.0) is None
    assert policy.due(159.0) is None
    alert = policy.due(160.0)
    assert alert is not None and alert.kind == alerts.BELOW_MIN_NODES
    assert alert.text == (
        "j1: waiting for nodes for 60 s: 1 ready, fewer than cluster.min_nodes=2 (round 4 lost "
        "members)"
    )
    assert policy.due(500.0) is None  # once per occurrence
    # A node back in time: the round it forms cancels the alert.
    assert policy.take(short, now=200.0) is None
    assert policy.take(event(ev.ROUND_FORMED, round=5), now=210.0) is None
    assert policy.due(1000.0) is None
    # 0 s: at once.
    at_once = AlertPolicy("j1", recoveries_per_hour=10, below_min_nodes_s=0)
    assert at_once.take(short, now=0.0) is not None


def test_the_job_done_is_an_alert_and_other_events_are_none() -> None:
    policy = AlertPolicy("j1", recoveries_per_hour=1, below_min_nodes_s=60)
    done = policy.take(event(ev.TRAINING_DONE, step=90, samples_seen=720, world_size=2), 0.0)
    assert done is not None and done.kind == alerts.JOB_DONE
    assert done.text == "j1: done: step 90, 720 samples trained"
    for kind in (ev.STEP, ev.FENCED, ev.NODE_LEFT, ev.NOTIFIED, ev.NOTIFY_FAILED):
        assert policy.take(event(kind), 0.0) is None


def test_a_failure_is_told_by_the_leader_with_no_one_left_to_carry_the_job() -> None:
    failed = alerts.failed("j1", "node0", 1, "no node finished the job", 5.0)
    assert failed.kind == alerts.JOB_FAILED and failed.payload()["code"] == 1
    assert failed.text == "j1: ended without finishing (exit code 1): no node finished the job"
    assert reports_failure(1, frozenset(), etcd_lost=False)  # the leader, alone
    assert not reports_failure(1, frozenset({"node1"}), etcd_lost=False)  # node1 goes on
    assert reports_failure(4, frozenset({"node1"}), etcd_lost=True)  # every node stops
    assert not reports_failure(1, None, etcd_lost=True)  # not the leader: the leader says it
    assert not reports_failure(0, frozenset(), etcd_lost=False)  # done: rank 0's event says it
    # Trained but unsaved: rank 0's final_save_failed says it (below).
    assert not reports_failure(EXIT_UNSAVED, frozenset(), etcd_lost=False)


def test_a_final_save_that_fails_alerts_once_and_giving_up_names_the_unsaved_steps() -> None:
    policy = AlertPolicy("j1", recoveries_per_hour=1, below_min_nodes_s=60)
    cause = {"reason": "[Errno 28] No space left on device", "fix": "free space"}
    assert policy.take(event(ev.CHECKPOINT_FAILED, step=103, round=2, **cause), 0.0) is None
    retry = {"step": 103, "saved_step": 45, "retry_in_s": 5.0, "left_s": 599.5}
    first = policy.take(event(ev.FINAL_SAVE_RETRY, attempt=1, **retry), 0.0)
    assert first is not None and first.kind == alerts.FINAL_SAVE_FAILING
    assert first.text == (
        "j1: trained, but the final checkpoint (step 103) does not commit: [Errno 28] No space "
        "left on device. Fix: free space; the state is kept and the save retried for 10 min "
        "(checkpoint.final_retry_s), newest saved: step 45"
    )
    assert policy.take(event(ev.FINAL_SAVE_RETRY, attempt=2, **retry), 5.0) is None  # once
    gave_up = event(ev.FINAL_SAVE_FAILED, step=103, saved_step=45, attempts=9, waited_s=600.0)
    failed = policy.take(gave_up, 600.0)
    assert failed is not None and failed.kind == alerts.JOB_FAILED
    assert failed.text == (
        f"j1: ended without its final checkpoint (exit code {EXIT_UNSAVED}): steps 46-103 were "
        "trained but are not saved: [Errno 28] No space left on device. Fix: free space; newest "
        "saved: step 45"
    )
    assert failed.payload()["saved_step"] == 45 and failed.payload()["step"] == 103


# --- who says the job waits for nodes: the leader ----------------------------------------------


def node(name: str, rev: int, ready: bool = True, leaving_after: int = 0) -> NodeRecord:
    return NodeRecord(name, "127.0.0.1", 1000, 1, 0, ready, leaving_after, rev)


A, B, C = node("a", 1), node("b", 2), node("c", 3)
TRAINED = Round.build(3, [A, B, C])


def test_short_of_nodes_when_a_round_lost_members_and_too_few_are_ready() -> None:
    lost_two = JobView({"a": A}, TRAINED, complete=True)
    assert short_of_nodes(lost_two, min_nodes=2, leader="a") == 1
    assert short_of_nodes(lost_two, min_nodes=1, leader="a") is None  # a trains on alone
    assert short_of_nodes(JobView({"a": A}, None, complete=True), 2, "a") is None  # not begun
    intact = JobView({"a": A, "b": B, "c": C}, TRAINED, complete=True)
    assert short_of_nodes(intact, min_nodes=3, leader="a") is None
    stopping = JobView({"a": node("a", 1, leaving_after=9)}, TRAINED, complete=True)
    assert short_of_nodes(stopping, min_nodes=2, leader="a") is None  # the job is being stopped
    assert short_of_nodes(replace(lost_two, done_in=3), min_nodes=2, leader="a") is None
    restarting = JobView({"a": A, "b": node("b", 2, ready=False)}, TRAINED, complete=True)
    assert short_of_nodes(restarting, min_nodes=2, leader="a") == 1


def test_the_leader_says_once_per_occurrence_that_the_job_waits_for_nodes() -> None:
    said: list[tuple[str, dict]] = []

    def emit(
        kind: ev.EventType, message: str | None = None, /, *, level: int = 0, **f: Any
    ) -> None:
        said.append((kind.name, f))

    keys = JobKeys("/elastic", "j1")
    leadership = Leadership(None, keys, RendezvousConfig(), 2, 3, emit)
    lead = leader_value("a", 1)
    short = JobView({"a": A}, TRAINED, 7, complete=True, leader=lead)
    again = Round.build(4, [A, B])
    for view in (short, short, JobView({"a": A, "b": B}, again, 9, complete=True, leader=lead)):
        assert leadership.maybe_propose(view, "a", 1, last_change=0.0) is None
    leadership.maybe_propose(JobView({"a": A}, again, 11, complete=True, leader=lead), "a", 1, 0.0)
    assert said == [
        ("below_min_nodes", {"ready": 1, "min_nodes": 2, "round": 3}),
        ("below_min_nodes", {"ready": 1, "min_nodes": 2, "round": 4}),
    ]


# --- the setting ----------------------------------------------------------------------------------


def test_alerts_are_off_by_default_and_a_webhook_must_be_an_http_url() -> None:
    assert (Config().notify.command, Config().notify.webhook) == ("", "")
    config.validate(replace(Config(), notify=NotifyConfig(webhook="https://hooks.example/T0")))
    for wrong in ("hooks.example/T0", "ftp://hooks.example/T0", "https:///T0"):
        with pytest.raises(ConfigError, match=r"notify.webhook=.*Fix: write the full URL"):
            config.validate(replace(Config(), notify=NotifyConfig(webhook=wrong)))
    with pytest.raises(ConfigError, match="notify.timeout_s=0"):
        config.validate(replace(Config(), notify=NotifyConfig(timeout_s=0)))


# --- how it is sent -------------------------------------------------------------------------------


def notifier(run_dir: Path, **notify: Any) -> Notifier:
    cfg = replace(Config(), job_id="j1", run_dir=str(run_dir), notify=NotifyConfig(**notify))
    return Notifier(cfg, "launcher")


QUARANTINE = event(ev.QUARANTINED, "node1", peer="node1", until=1060.0, by="agent", reasons=["x"])


def test_the_webhook_gets_the_alert_as_json_and_the_delivery_is_an_event(
    tmp_path: Path, webhook: tuple[str, queue.Queue[tuple[str, dict]]]
) -> None:
    url, received = webhook
    n = notifier(tmp_path, webhook=url)
    n.follow([event(ev.STEP), QUARANTINE])
    path, body = received.get(timeout=10)
    n.close()
    assert path == "/hooks/T0"
    assert body["kind"] == "node_quarantined" and body["job_id"] == "j1"
    assert body["node"] == "node1" and body["ts"] == 1000.0 and body["reasons"] == ["x"]
    assert body["text"] == "j1: node1 quarantined for 60 s by agent (x)"
    [done] = ev.NOTIFIED.of(read_events(tmp_path))
    assert (done["alert"], done["target"]) == ("node_quarantined", "notify.webhook")
    assert done["node"] == "launcher" and done["role"] == "launcher"
    assert received.empty()


def test_the_command_gets_the_json_on_stdin_and_the_summary_in_its_environment(
    tmp_path: Path,
) -> None:
    out = tmp_path / "alert"
    summary = "$ELASTIC_ALERT_KIND|$ELASTIC_ALERT_JOB|$ELASTIC_ALERT_NODE|$ELASTIC_ALERT_TEXT"
    command = f'cat > {out}.json && echo "{summary}" > {out}.env'
    n = notifier(tmp_path, command=command)
    n.send(alerts.failed("j1", "launcher", 130, "stopped by SIGINT", 7.0))
    n.close()
    body = json.loads(Path(f"{out}.json").read_text())
    assert body == {
        "code": 130,
        "reason": "stopped by SIGINT",
        "kind": "job_failed",
        "job_id": "j1",
        "node": "launcher",
        "text": "j1: ended without finishing (exit code 130): stopped by SIGINT",
        "ts": 7.0,
    }
    assert Path(f"{out}.env").read_text() == (
        "job_failed|j1|launcher|j1: ended without finishing (exit code 130): stopped by SIGINT\n"
    )
    assert [e["target"] for e in ev.NOTIFIED.of(read_events(tmp_path))] == ["notify.command"]


def refused_url() -> str:
    with socket.socket() as s:  # a port that was free a moment ago, and nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/"


def test_a_webhook_that_refuses_or_hangs_and_a_command_that_fails_or_hangs_never_hold_the_caller(
    tmp_path: Path,
) -> None:
    """Each failure is one notify_failed event with its reason; sending returns at once, and the
    end waits at most the timeout of each call."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        hangs = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        cases = [
            ({"webhook": refused_url()}, "the webhook could not be reached: [Errno 111]"),
            ({"webhook": hangs}, "the webhook did not answer within notify.timeout_s=0.5"),
            ({"command": "echo no mail >&2; exit 3"}, "the command exited with code 3: no mail"),
            ({"command": "sleep 60"}, "the command did not end within notify.timeout_s=0.5"),
        ]
        for i, (setting, reason) in enumerate(cases):
            run_dir = tmp_path / str(i)
            n = notifier(run_dir, timeout_s=0.5, **setting)
            began = time.monotonic()
            n.follow([QUARANTINE])
            assert time.monotonic() - began < 0.2
            n.close()
            assert time.monotonic() - began < 0.5 + CLEANUP_S + 0.5  # the bound, and slack
            [failed] = ev.NOTIFY_FAILED.of(read_events(run_dir))
            assert failed["reason"].startswith(reason), failed
            assert failed["alert"] == "node_quarantined"
            assert not ev.NOTIFIED.of(read_events(run_dir))


def test_without_a_command_or_webhook_nothing_is_started_or_written(tmp_path: Path) -> None:
    n = notifier(tmp_path)
    n.follow([QUARANTINE])
    n.send(alerts.failed("j1", "launcher", 1, "x", 0.0))
    n.close()
    assert not (tmp_path / "events").exists()
    assert not any(t.name == "notify" for t in threading.enumerate())
