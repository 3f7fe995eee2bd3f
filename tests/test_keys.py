"""The etcd key layout (launcher/rendezvous/keys.py), written out: old run directories' operators
and ``etcdctl`` users rely on these names, so a change to one must be deliberate."""

from __future__ import annotations

from launcher.rendezvous.keys import JobKeys


def test_every_key_of_a_job_is_under_one_of_its_three_trees() -> None:
    k = JobKeys("/elastic", "run1")
    assert (k.rendezvous, k.node("a"), k.round, k.leader, k.done, k.progress) == (
        "/elastic/run1/",
        "/elastic/run1/nodes/a",
        "/elastic/run1/round",
        "/elastic/run1/leader",
        "/elastic/run1/done",
        "/elastic/run1/progress",
    )
    assert k.round_part_folder("r7") == "/elastic/run1/round_parts/r7/"
    assert k.quarantined("a") == "/elastic/run1/quarantine/a"
    assert (k.report("a"), k.strike("a")) == (
        "/elastic/run1.health/reports/a",
        "/elastic/run1.health/strikes/a",
    )
    assert k.requests("a") + "x1" == "/elastic/run1.chaos/requests/a/x1"
    assert k.answer("a", "x1") == "/elastic/run1.chaos/answers/a/x1"
    start, end = k.everything()
    every = [k.node("a"), k.quarantined("a"), k.report("a"), k.answer("a", "x1"), k.progress]
    assert all(start <= key < end for key in every)
