"""What the launcher checks before any agent starts: the places the job will need.

:func:`launcher.compose.validate_launch` checks the values; this checks the world they point
at: the etcd endpoints answer, the checkpoint URL can be written. The job's own places (the
ImageNet job's data root) are its rules' (:meth:`elastic.job.Job.problems`). A
launch that fails here has started nothing and created nothing, and each problem names the key,
the value and the fix, like a config error. The agents still check their own node before they join
(:mod:`launcher.health.checks`); this only spares every node of a job from finding the same shared
fault one by one, and the operator from waiting for it.
"""

from __future__ import annotations

from elastic.config import Config, problem
from launcher.health.checks import local_path, writable_dir_problem
from launcher.rendezvous.etcd import EtcdRefused, EtcdUnavailable, connect, etcd_security


def preflight(cfg: Config) -> list[str]:
    """Every problem found, each as ``key=value: why. Fix: ...``; empty when the launch may go."""
    return [p for p in (_etcd(cfg), _checkpoint_url(cfg)) if p]


def _etcd(cfg: Config) -> str:
    endpoints = list(cfg.cluster.etcd_endpoints)
    if not endpoints:
        return ""  # the launcher starts an embedded etcd
    try:
        client = connect(
            endpoints, timeout_s=cfg.health.etcd_timeout_s, security=etcd_security(cfg.cluster)
        )
    except EtcdRefused as exc:  # it answered: the message names the setting and the fix
        return f"etcd refuses this node: {exc}"
    except EtcdUnavailable as exc:
        return problem(
            "cluster.etcd_endpoints",
            endpoints,
            f"no endpoint answered within health.etcd_timeout_s={cfg.health.etcd_timeout_s:g} "
            f"({exc})",
            "start etcd, or point cluster.etcd_endpoints at the running cluster's members",
        )
    client.close()
    return ""


def _checkpoint_url(cfg: Config) -> str:
    """The nodes' disk check of ``checkpoint.url``, once, before any node starts.

    It applies the same rule (:func:`launcher.health.checks.writable_dir_problem`)."""
    url = cfg.checkpoint.url
    target = local_path(url)
    if target is None:
        return ""  # a remote store: its own credentials and semantics, checked by the first save
    why = writable_dir_problem(target)
    if not why:
        return ""
    return problem(
        "checkpoint.url",
        url,
        why,
        "point checkpoint.url at a writable directory (file:///shared/ckpt or an fsspec URL such "
        "as s3://bucket/job)",
    )
