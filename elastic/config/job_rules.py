"""The rules a range cannot say about where the job runs: cluster, id, etcd, checkpoints, alerts.

One rule function per section, each yielding :func:`~elastic.config.schema.problem` strings for
:func:`elastic.config.validate`: relations between keys (``cluster.min_nodes`` against the most a
round holds), formats (etcd endpoints, the job id, the rendezvous prefix, the alerts' webhook),
and what the machine must have (an fsspec backend for ``checkpoint.url``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from urllib.parse import urlsplit

from elastic.config.job import Config, max_nodes
from elastic.config.schema import problem

# A job id is one path segment and one etcd key segment. Without '/' and '.', the job's keys
# (<prefix>/<job_id>/ and <prefix>/<job_id>.health/) are never under another job's prefix.
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")


def cluster_problems(cfg: Config) -> Iterator[str]:
    """The problems of the ``cluster`` section.

    It checks the nodes a round may hold, the embedded etcd's size, what bare metal needs, and
    the etcd endpoints' form."""
    c = cfg.cluster
    if c.min_nodes > max_nodes(cfg):
        yield problem(
            "cluster.min_nodes",
            c.min_nodes,
            f"more than the most nodes a round may hold ({max_nodes(cfg)})",
            "lower cluster.min_nodes or raise cluster.max_nodes / cluster.nodes",
        )
    if c.embedded_etcd_members not in (1, 3):
        yield problem(
            "cluster.embedded_etcd_members",
            c.embedded_etcd_members,
            "etcd needs an odd number of members, and a 3-member cluster is the one that "
            "survives the loss of a member",
            "set cluster.embedded_etcd_members=1 or 3",
        )
    if c.mode == "bare_metal":
        if not cfg.job_id:
            yield problem(
                "job_id",
                cfg.job_id,
                "bare_metal nodes find each other by job id",
                "pass job_id=<name>, the same on every node",
            )
        if not c.etcd_endpoints:
            yield problem(
                "cluster.etcd_endpoints",
                c.etcd_endpoints,
                "bare_metal nodes need a shared etcd cluster",
                "pass cluster.etcd_endpoints=[host1:2379,host2:2379,host3:2379]",
            )
    for ep in c.etcd_endpoints:
        host, _, port = ep.rpartition(":")
        if not (host and port.isdigit()):
            yield problem(
                "cluster.etcd_endpoints",
                ep,
                "an endpoint is host:port",
                "write each endpoint as host:port, e.g. 10.0.0.1:2379",
            )


def job_id_problems(cfg: Config) -> Iterator[str]:
    if cfg.job_id and JOB_ID.fullmatch(cfg.job_id) is None:
        yield problem(
            "job_id",
            cfg.job_id,
            "it names the run directory and the job's etcd keys, so it must be one safe path "
            "segment that no other job id extends (no '/', '.', spaces)",
            "use letters, digits, '-' and '_', at most 128, starting with a letter or digit "
            "(e.g. job_id=resnet50-run1)",
        )


def rendezvous_problems(cfg: Config) -> Iterator[str]:
    prefix = cfg.rendezvous.prefix
    if not (prefix.startswith("/") and not prefix.endswith("/")):
        yield problem(
            "rendezvous.prefix",
            prefix,
            "must start with '/' and not end with one",
            "use e.g. rendezvous.prefix=/elastic",
        )


def checkpoint_problems(cfg: Config) -> Iterator[str]:
    """``checkpoint.url``'s scheme must have an fsspec backend installed."""
    url = cfg.checkpoint.url
    if not url:
        return
    import fsspec

    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        yield problem(
            "checkpoint.url",
            url,
            f"fsspec cannot write there ({exc})",
            "use a file:// URL or install the fsspec backend for that scheme",
        )


def chaos_problems(cfg: Config) -> Iterator[str]:
    """Test hooks that break a job on purpose need chaos.allow."""
    c = cfg.chaos
    if c.nan_steps and not c.allow:
        yield problem(
            "chaos.nan_steps",
            list(c.nan_steps),
            "makes a rank's loss NaN on purpose, a test hook",
            "set chaos.allow=true to inject them, or chaos.nan_steps=[]",
        )
    if c.nan_rank < 0:
        yield problem("chaos.nan_rank", c.nan_rank, "no such rank", "set a rank of the job, e.g. 0")
    if c.fail_collectives_node and not c.allow:
        yield problem(
            "chaos.fail_collectives_node",
            c.fail_collectives_node,
            "makes a node's collectives fail on purpose, a test hook",
            'set chaos.allow=true to inject it, or chaos.fail_collectives_node=""',
        )
    if c.fail_collectives_node and c.fail_collectives_step < 1:
        yield problem(
            "chaos.fail_collectives_step",
            c.fail_collectives_step,
            "no such step: steps count from 1",
            "set the step from which collectives fail, e.g. chaos.fail_collectives_step=10",
        )


def notify_problems(cfg: Config) -> Iterator[str]:
    """``notify.webhook`` must be an http(s) URL with a host.

    Anything else would fail at the first alert, days into the run, when nobody is looking."""
    url = cfg.notify.webhook
    if not url:
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        yield problem(
            "notify.webhook",
            url,
            "alerts are POSTed to an http(s) URL with a host",
            "write the full URL, e.g. notify.webhook=https://hooks.example.com/T0/B0, or "
            "notify.webhook='' for no webhook",
        )
