"""Evicting a dead peer: deleting its key, if it is still the registration that died.

A peer that sees a node die deletes its key instead of waiting for its lease to expire. The delete
is conditioned on the key's create revision, so a node that registered again (a new member) is
never evicted for its earlier registration's death; when the dead node leads, the ``leader`` key
goes in the same transaction, so that the others elect a new leader at once.
"""

from __future__ import annotations

import logging

from elastic import event_types as ev
from launcher.rendezvous.etcd import etcd_errors
from launcher.rendezvous.etcd_client import EtcdClient
from launcher.rendezvous.keys import JobKeys
from launcher.rendezvous.lease import Emit
from launcher.rendezvous.membership import Member, NodeRecord, leader_value

# The rendezvous's log, as its lines have always been named.
log = logging.getLogger("launcher.rendezvous.rendezvous")


def evict(
    etcd: EtcdClient,
    keys: JobKeys,
    leader: str,
    member: Member | NodeRecord,
    reason: str,
    emit: Emit,
) -> bool:
    """Delete ``member``'s key (and the ``leader`` key if it leads) and emit ``peer_evicted``.

    The ``leader`` key goes too if ``leader``, the view's value of it, is ``member``'s. False if the
    key is not that registration's (gone already, or registered again), or etcd did not answer: the
    caller may try again."""
    t = etcd.transactions
    key = keys.node(member.node_id)
    held = leader_value(member.node_id, member.joined_rev)
    try:
        ok = False
        if leader == held:  # it leads: the others need a new leader at once
            ok, _ = etcd.transaction(
                compare=[t.create(key) == member.joined_rev, t.value(keys.leader) == held],
                success=[t.delete(key), t.delete(keys.leader)],
                failure=[],
            )
        if not ok:
            ok, _ = etcd.transaction(
                compare=[t.create(key) == member.joined_rev],
                success=[t.delete(key)],
                failure=[],
            )
    except etcd_errors() as exc:
        log.info("etcd unavailable (%s); evicting %s later", exc, member.node_id)
        return False
    if ok:
        emit(ev.PEER_EVICTED, peer=member.node_id, reason=reason)
    return bool(ok)
