"""What a job costs etcd over time, and whether etcd still has room for it.

etcd keeps every revision of every key until its history is compacted, and its database file
keeps the pages a compaction freed until the member is defragmented. Past its space quota
(``--quota-backend-bytes``, 2 GiB by default) it raises the ``NOSPACE`` alarm and refuses every
write (gRPC ``RESOURCE_EXHAUSTED``) until an operator frees space and disarms the alarm; reads
and lease keep-alives still work, so a job trains on but can neither change rounds nor admit a
node. Here: :func:`usage` (revision and database size, for the soak bench, the doctor and the
embedded etcd), :func:`revisions_per_hour`, :func:`compacted` (has etcd ever compacted its
history), :func:`alarms` and :func:`out_of_space`, which names a refused write as ``NOSPACE``
with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from launcher.rendezvous.etcd import etcd_errors

MB = 1 << 20
DEFAULT_QUOTA_BYTES = 2 << 30  # etcd's --quota-backend-bytes when it is not set (or 0)

# etcd's status answer carries the bytes in use (dbSizeInUse, field 9, etcd >= 3.4); the etcd3
# client's copy of the protocol predates it, so the field arrives as an unknown one.
_DB_SIZE_IN_USE_FIELD = 9

# etcd's alarm types (etcdserverpb.AlarmType), by number.
NOSPACE, CORRUPT = 1, 2
ALARM_NAMES = {NOSPACE: "NOSPACE", CORRUPT: "CORRUPT"}


class Usage(NamedTuple):
    """One member's answer to a status call: the revision and the database file's sizes.

    Its fields: the cluster's revision, the size of the member's database file, and how much of it
    holds data (None from an etcd older than 3.4). Between the two sizes lie free pages, reused by
    later writes and given back by a defragmentation."""

    revision: int
    db_size: int
    db_size_in_use: int | None


def usage(client: Any) -> Usage:
    """The :class:`Usage` of the member ``client`` talks to; raises what etcd raises."""
    etcd_errors()  # the protobuf mode the etcd client needs, before its import
    from etcd3 import etcdrpc
    from google.protobuf.unknown_fields import UnknownFieldSet

    response = client.maintenancestub.Status(
        etcdrpc.StatusRequest(),
        client.timeout,
        credentials=client.call_credentials,
        metadata=client.metadata,
    )
    in_use = next(
        (f.data for f in UnknownFieldSet(response) if f.field_number == _DB_SIZE_IN_USE_FIELD),
        None,
    )
    return Usage(response.header.revision, response.dbSize, in_use)


def revisions_per_hour(before: Usage, after: Usage, seconds: float) -> float:
    """The revisions written between two :func:`usage` readings ``seconds`` apart, per hour."""
    return (after.revision - before.revision) * 3600.0 / seconds


def compacted(client: Any, key: str) -> bool:
    """Whether etcd has ever compacted its history.

    The test: a read of ``key`` as of revision 1, which every etcd had, is refused with
    ``OUT_OF_RANGE`` ("required revision has been compacted") once a compaction past it ran. The
    same code says "future revision", which revision 1 never is. ``key``: one the caller may read,
    the job's own under etcd auth."""
    etcd_errors()
    import grpc
    from etcd3 import etcdrpc

    try:
        client.kvstub.Range(
            etcdrpc.RangeRequest(key=key.encode(), revision=1),
            client.timeout,
            credentials=client.call_credentials,
            metadata=client.metadata,
        )
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
            return True
        raise
    return False


def alarms(client: Any) -> list[tuple[str, str]]:
    """The active alarms, as (alarm name, the member's client address, or its id in hex)."""
    members = {m.id: (m.client_urls[0] if m.client_urls else m.name) for m in client.members}
    return [
        (
            ALARM_NAMES.get(a.alarm_type, str(a.alarm_type)),
            str(members.get(a.member_id, f"{a.member_id:x}")).removeprefix("http://"),
        )
        for a in client.list_alarms()
    ]


def nospace_fix(endpoint: str, revision: int) -> str:
    """The operator's way out of ``NOSPACE`` on the etcd at ``endpoint``, now at ``revision``."""
    e = f"--endpoints={endpoint}"
    return (
        f"free space, then disarm the alarm: etcdctl {e} compact {revision}; etcdctl {e} defrag "
        f"--cluster; etcdctl {e} alarm disarm. Then keep it bounded: run every etcd member with "
        "--auto-compaction-mode=periodic --auto-compaction-retention=1h and a "
        "--quota-backend-bytes that fits (etcd's default is 2 GiB, at most 8 GiB; "
        'docs/bare-metal.md, "An external etcd")'
    )


@dataclass(frozen=True)
class NoSpace:
    """etcd refuses writes: the ``NOSPACE`` alarm of the member at ``member`` is raised."""

    member: str
    usage: Usage

    @property
    def reason(self) -> str:
        return (
            f"etcd at {self.member} is out of space (NOSPACE alarm: its database, "
            f"{self.usage.db_size / MB:.1f} MB, passed its --quota-backend-bytes) and refuses "
            "every write until the alarm is disarmed"
        )

    @property
    def fix(self) -> str:
        return nospace_fix(self.member, self.usage.revision)

    def __str__(self) -> str:
        return f"{self.reason}. Fix: {self.fix}"


def out_of_space(client: Any, exc: BaseException) -> NoSpace | None:
    """Whether etcd refused the call that raised ``exc`` for lack of space, and where.

    By structure, not by the message: etcd answers ``RESOURCE_EXHAUSTED`` both for a full
    database and for "too many requests" (and gRPC for a message over its size limit), so the
    code alone does not tell; the ``NOSPACE`` alarm, which etcd raises as it refuses the first
    write over its quota and keeps until an operator disarms it, does. None when the call
    failed otherwise, or when the alarms cannot be read."""
    etcd_errors()
    import grpc

    if not isinstance(exc, grpc.RpcError) or exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    try:
        full = [member for name, member in alarms(client) if name == "NOSPACE"]
        return NoSpace(full[0], usage(client)) if full else None
    except etcd_errors():
        return None
