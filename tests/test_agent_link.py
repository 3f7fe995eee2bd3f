"""The worker's end of the control channel in a planned leave, over a real socket pair.

A draining agent asks its worker which step it can stop after, forms the round without the
node, and sends a standby for after that step; it lets the node leave once the worker echoes
the standby's number. These are the ways that went wrong on a loaded machine (the degraded
node's e2e test, issue 47): the standby came after the worker had begun the next step, whose
all-reduce then failed on the peers that had left; the round left that way, the echo never came,
so the node never left, nor joined again; and a survivor's word came once it had begun that step.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.agent_link import AgentLink
from elastic.communicator import Communicator
from elastic.control import Channel
from elastic.ddp_hook import DDPHook

WAIT_S = 10.0


class Agent:
    """The agent's end: sends messages, and keeps every one the worker sends but heartbeats."""

    def __init__(self) -> None:
        self.channel, theirs = Channel.pair()
        comm = Communicator(torch.device("cpu"), timeout_s=5)
        self.link = AgentLink(Channel(theirs), comm, DDPHook(comm))
        self.received: queue.Queue[dict[str, Any]] = queue.Queue()
        self.channel.serve(self._keep, name="agent")

    def _keep(self, msg: dict[str, Any]) -> None:
        if msg["type"] != "status" or "stood_by" in msg:
            self.received.put(msg)

    def next(self, kind: str) -> dict[str, Any]:
        while True:
            msg = self.received.get(timeout=WAIT_S)
            if msg["type"] == kind:
                return msg

    def ask_to_leave(self, in_flight: int) -> int:
        """The worker trains step ``in_flight``; the step it says it can stop after."""
        self.link.status.update(phase="step", step=in_flight)
        self.channel.send("leave")
        return int(self.next("leaving")["after_step"])


def test_a_draining_worker_holds_at_its_step_until_the_standby_and_echoes_it() -> None:
    agent = Agent()
    after = agent.ask_to_leave(in_flight=18)
    assert after == 19  # the peers may have begun step 19: it stops after that one
    result: list[bool] = []
    trainer = threading.Thread(target=lambda: result.append(agent.link.begin_step(after + 1)))
    trainer.start()
    trainer.join(0.5)
    assert trainer.is_alive(), "it began step 20 without its agent's word"
    agent.channel.send("standby", after_step=after, seq=7)
    trainer.join(WAIT_S)
    assert result == [False]  # step 20 not begun: the round was left after step 19
    assert agent.next("status")["stood_by"] == 7  # the agent may let the node leave
    assert agent.link.comm.aborted


def test_a_round_left_on_a_lost_peer_still_echoes_the_standby_and_drops_its_switch() -> None:
    agent = Agent()
    agent.link.status.update(phase="step", step=19)  # the standby came during step 19
    agent.channel.send("standby", after_step=19, seq=8)
    agent.ask_to_leave(in_flight=19)  # answered after the standby: the reader took that in
    agent.link.left_round()  # step 19's all-reduce failed on a peer lost meanwhile
    assert agent.next("status")["stood_by"] == 8
    assert agent.link.begin_step(22)  # the next round's steps: no stale switch, no hold


def test_a_switch_that_comes_once_the_next_step_began_drops_that_step_at_once() -> None:
    """The others' side of the same race: a survivor began step 20 before its assignment "after
    step 19" came, and the leaver, holding at 19, never joins step 20's all-reduce."""
    agent = Agent()
    agent.link.status.update(phase="step", step=20)
    agent.channel.send("standby", after_step=19, seq=9)
    assert agent.next("status")["stood_by"] == 9  # carried out at once, not after step 20
    assert agent.link.comm.aborted


def test_a_step_begun_and_a_switch_that_comes_then_see_each_other() -> None:
    """A survivor's assignment came while its training thread was between the check for a
    switch and marking step 20 begun (the degraded-node loop, 1 in 18 runs): it took step 20 for
    not begun, planned the switch for after it, and sat in step 20's all-reduce with the
    leaver, who never joined. The step is marked begun under the reader's lock now."""
    agent = Agent()
    agent.link.status.update(phase="step", step=19)
    assert agent.link.begin_step(20)
    assert agent.link.status["step"] == 20  # begun as the check passed, not later
    agent.channel.send("standby", after_step=19, seq=10)
    assert agent.next("status")["stood_by"] == 10


def test_a_worker_leaving_as_planned_says_so_once_the_next_round_is_being_set_up() -> None:
    """The leaver's agent stops it once it says it left. A survivor may still be in step 20's
    all-reduce, its own assignment not yet read (0.3 s on 2 loaded cores, the degraded-node
    loop): stopped then, the leaver broke that step as a lost peer would. So it says it left
    once every member of the next round reached that round's set-up, on the round's store."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    agent = Agent()
    agent.link.status.update(phase="step", step=20)  # held: the leaver's step 20 never begins
    handover = {"next_round": 2, "world_size": 2, "store_host": "127.0.0.1"}
    agent.channel.send("standby", after_step=19, seq=11, store_port=server.port, **handover)
    server.set("round2/arrived/0", b"")
    with pytest.raises(queue.Empty):  # rank 1 of round 2 is still in round 1
        agent.received.get(timeout=0.5)
    server.set("round2/arrived/1", b"")
    assert agent.next("status")["stood_by"] == 11
    assert agent.link.comm.aborted
