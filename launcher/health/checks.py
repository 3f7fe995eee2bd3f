"""Is this node fit to join a round? The checks of the host, and the report they make.

ChainerMN's ImageNet-in-15-minutes run kept crashing as it grew, not from bugs in training but
from the machines: NCCL ran out of file descriptors under the default ``ulimit -n``, threads
overflowed the default stack, and some GPUs were broken. One such node drags every round it joins
down with it, so an agent proves its node fit before every join, and a node that fails does not
join. Each check says pass, warn, fail or skip, naming the limit, the value found and the fix.
The GPU checks are :mod:`launcher.health.gpu`'s; :func:`run_checks` runs both into a report. The
checks cost only what they need: a checkpoint's size comes from the newest manifest, and only a
job without one builds the model (on the meta device) to size it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import hashlib
import http.client
import importlib.metadata
import json
import os
import resource
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic.cache import cached
from elastic.config import Config, ConfigError, HealthConfig
from elastic.job_target import job_class
from elastic.manifest import committed, manifest_bytes, newest_manifest
from launcher.health.gpu import gpu_checks
from launcher.health.node_report import CheckResult, HealthReport, Status
from launcher.rendezvous.embedded_etcd import etcd_binary
from launcher.rendezvous.etcd import INSECURE, EtcdRefused, EtcdSecurity, etcd_security

MB = 1 << 20
GB = 1 << 30
# A wall clock before this is unset (an RTC that lost power reads 1970 or the firmware's date).
SANE_EPOCH = 1_735_689_600  # 2025-01-01 UTC


# --- resource limits --------------------------------------------------------------------------


def _limit(value: int, unit: int = 1, suffix: str = "") -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value // unit}{suffix}"


def _raise_soft(which: int, target: int) -> tuple[int, int, int]:
    """Raise the soft limit of ``which`` to ``target``, capped by the hard limit.

    It is raised for this process and so for every worker it starts. Returns (soft before, soft
    now, hard)."""
    soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        target = hard if target == resource.RLIM_INFINITY else min(target, hard)
    below = soft != resource.RLIM_INFINITY and (target == resource.RLIM_INFINITY or soft < target)
    if below:
        with contextlib.suppress(ValueError, OSError):  # reported as the soft limit that stayed
            resource.setrlimit(which, (target, hard))
    return soft, resource.getrlimit(which)[0], hard


def check_open_files(cfg: HealthConfig) -> CheckResult:
    """RLIMIT_NOFILE: the soft limit is raised to the hard one, and must reach the minimum."""
    before, soft, hard = _raise_soft(resource.RLIMIT_NOFILE, resource.RLIM_INFINITY)
    raised = f"; soft limit raised from {before}" if soft != before else ""
    if soft != resource.RLIM_INFINITY and soft < cfg.min_open_files:
        return CheckResult(
            "open_files",
            Status.FAIL,
            f"RLIMIT_NOFILE is {soft} (hard limit {_limit(hard)}), below "
            f"health.min_open_files={cfg.min_open_files}: NCCL and the data loader run out of "
            "descriptors ('unhandled system error'). Fix: raise the hard limit of the agent's "
            "user (ulimit -Hn 1048576 as root, nofile in /etc/security/limits.conf, "
            "LimitNOFILE= in its systemd unit, docker --ulimit nofile=...), or lower "
            "health.min_open_files",
        )
    return CheckResult(
        "open_files",
        Status.PASS,
        f"RLIMIT_NOFILE {_limit(soft)} (hard {_limit(hard)}) >= "
        f"health.min_open_files={cfg.min_open_files}{raised}",
    )


def check_stack(cfg: HealthConfig) -> CheckResult:
    """RLIMIT_STACK: a lower soft limit is raised to the minimum, if the hard limit allows.

    Only up to the minimum, not to the hard limit: glibc sizes every new thread's stack from the
    soft limit, so a huge finite one would reserve that much address space per thread.
    """
    need = cfg.min_stack_mb * MB
    before, soft, hard = _raise_soft(resource.RLIMIT_STACK, need)
    raised = f"; soft limit raised from {_limit(before, MB, ' MB')}" if soft != before else ""
    if soft != resource.RLIM_INFINITY and soft < need:
        return CheckResult(
            "stack",
            Status.FAIL,
            f"RLIMIT_STACK is {_limit(soft, MB, ' MB')} (hard limit {_limit(hard, MB, ' MB')}), "
            f"below health.min_stack_mb={cfg.min_stack_mb}: deep call chains in communication "
            "threads overflow it and segfault. Fix: raise the hard limit of the agent's user "
            "(ulimit -Hs unlimited as root, stack in /etc/security/limits.conf, LimitSTACK= in "
            "its systemd unit), or lower health.min_stack_mb",
        )
    return CheckResult(
        "stack",
        Status.PASS,
        f"RLIMIT_STACK {_limit(soft, MB, ' MB')} (hard {_limit(hard, MB, ' MB')}) >= "
        f"health.min_stack_mb={cfg.min_stack_mb}{raised}",
    )


# --- storage ----------------------------------------------------------------------------------


def check_shm(cfg: HealthConfig, required: bool, path: str = "/dev/shm") -> CheckResult:
    """Free space in /dev/shm. ``required``: NCCL or loader workers will use it (fail, not warn)."""
    try:
        free = shutil.disk_usage(path).free
    except OSError as exc:
        return CheckResult(
            "shm",
            Status.FAIL if required else Status.WARN,
            f"{path} is not usable ({exc}). Fix: mount a tmpfs there (docker --shm-size=8g)",
        )
    if free < cfg.min_shm_mb * MB:
        why = (
            "NCCL's intra-node transport and the data loader's workers need it"
            if required
            else "a CPU job without loader workers can do without, but NCCL and loader workers "
            "cannot"
        )
        return CheckResult(
            "shm",
            Status.FAIL if required else Status.WARN,
            f"{path} has {free // MB} MB free, below health.min_shm_mb={cfg.min_shm_mb}: {why}. "
            "Fix: enlarge it (mount -o remount,size=8G /dev/shm; docker --shm-size=8g) or lower "
            "health.min_shm_mb",
        )
    return CheckResult(
        "shm", Status.PASS, f"{path} {free // MB} MB free >= health.min_shm_mb={cfg.min_shm_mb}"
    )


def checkpoint_bytes(cfg: Config, size_model: bool = True) -> int | None:
    """The size of one checkpoint, or None when it is not known.

    It is what the newest committed one takes (its manifest, read without torch). Before the
    first one, with ``size_model``, it is the model's size (:func:`model_bytes`)."""
    manifest = newest_manifest(cfg.checkpoint.url)
    if manifest is not None:
        return manifest_bytes(manifest)
    return model_bytes(cfg) if size_model else None


def model_bytes(cfg: Config) -> int:
    """The size of a checkpoint of the job's model: parameters, buffers and the SGD momentum.

    They are counted on the meta device, so nothing is allocated. The size is learned once per
    job, its settings and model, and torch and torchvision versions (:mod:`elastic.cache`)."""

    def learn() -> int:
        # Imported here: torch and torchvision take seconds, which only a node sizing a model
        # no cache knows yet pays.
        import torch

        from elastic.job_target import build_job

        with torch.device("meta"):
            model = build_job(cfg, torch.device("meta")).build_model()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        return 2 * params + buffers

    versions = "-".join(
        f"{package}-{importlib.metadata.version(package)}" for package in ("torch", "torchvision")
    )
    # What the model depends on: the job and its settings, the model and data groups (the
    # ImageNet job's class count); a change to any of them is another model.
    what = json.dumps(
        [cfg.job, dataclasses.asdict(cfg.model), dataclasses.asdict(cfg.data)],
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha256(what.encode()).hexdigest()[:16]
    name = f"model-bytes-{digest}-{versions}"
    return cached(name, lambda found: isinstance(found, int) and found > 0, learn)


def checkpoints_to_fit(keep: int, on_disk: int) -> int:
    """How many checkpoints the free space must still hold.

    A save writes a new one before the oldest beyond ``checkpoint.keep`` goes (keep + 1 at the
    peak), and the ``on_disk`` ones already have their space. At least one: the next save needs
    room of its own."""
    return max(1, keep + 1 - on_disk)


def local_path(url: str) -> Path | None:
    """The local directory a checkpoint URL names (``file://`` or a plain path).

    None for a remote store."""
    protocol, _, path = url.partition("://") if "://" in url else ("file", "", url)
    return Path(path) if protocol in ("file", "local") else None


def nearest_existing(path: Path) -> Path:
    """``path``, or the nearest of its ancestors that exists (where a new folder would go)."""
    return next(p for p in (path, *path.parents) if p.exists())


def writable_dir_problem(path: Path) -> str:
    """Why checkpoints cannot be written under ``path`` (created if missing), or "".

    Nothing is created. The nearest existing ancestor must be a directory this process may write
    in, on a file system mounted read-write."""
    existing = nearest_existing(path)
    if not existing.is_dir():
        return f"{existing} is a regular file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user (or its file system is read-only)"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{existing} is on a read-only file system"
    return ""


def check_checkpoint_disk(cfg: Config, size_model: bool = True) -> CheckResult:
    """Free space and write access where checkpoints go (local paths only).

    Room for the checkpoints still to come (:func:`checkpoints_to_fit`: ``checkpoint.keep + 1``
    at the peak, less those already on disk), and at least ``health.min_checkpoint_free_gb``.
    Without ``size_model`` and before the first checkpoint, the size of one is not known and
    only the latter is checked.
    """
    url = cfg.checkpoint.url
    target = local_path(url)
    if target is None:
        return CheckResult(
            "checkpoint_disk",
            Status.SKIP,
            f"checkpoint.url={url} is not a local path ({url.partition('://')[0]}); free space "
            "not checked",
        )
    why = writable_dir_problem(target)
    if why:
        return CheckResult(
            "checkpoint_disk",
            Status.FAIL,
            f"{why} (for checkpoint.url={url}). Fix: make it writable or point checkpoint.url at "
            "a writable shared directory",
        )
    existing = nearest_existing(target)
    free = shutil.disk_usage(existing).free
    one = checkpoint_bytes(cfg, size_model)
    if one is None:
        return _checkpoint_disk_unsized(cfg, existing, free)
    on_disk = sum(1 for _ in committed(url))
    more = checkpoints_to_fit(cfg.checkpoint.keep, on_disk)
    need = max(cfg.health.min_checkpoint_free_gb * GB, more * one)
    if free < need:
        return CheckResult(
            "checkpoint_disk",
            Status.FAIL,
            f"{existing} has {free / GB:.2f} GB free, below the {need / GB:.2f} GB needed "
            f"(health.min_checkpoint_free_gb={cfg.health.min_checkpoint_free_gb}, and room for "
            f"{more} more checkpoint(s) of {one / MB:.0f} MB: checkpoint.keep + 1 = "
            f"{cfg.checkpoint.keep + 1} at the peak, {on_disk} on disk). Fix: free space, point "
            "checkpoint.url elsewhere, or lower checkpoint.keep",
        )
    return CheckResult(
        "checkpoint_disk",
        Status.PASS,
        f"{existing} {free / GB:.1f} GB free, writable; needs {need / GB:.2f} GB",
    )


def _checkpoint_disk_unsized(cfg: Config, existing: Path, free: int) -> CheckResult:
    """The disk check before the first checkpoint, when the model is not sized (the doctor).

    It checks against ``health.min_checkpoint_free_gb`` alone."""
    need = cfg.health.min_checkpoint_free_gb * GB
    unknown = (
        "the size of one checkpoint is not known before the first one is written (the agent "
        "sizes the job's model on the meta device before joining)"
    )
    if free < need:
        return CheckResult(
            "checkpoint_disk",
            Status.FAIL,
            f"{existing} has {free / GB:.2f} GB free, below "
            f"health.min_checkpoint_free_gb={cfg.health.min_checkpoint_free_gb}; {unknown}. "
            "Fix: free space, point checkpoint.url elsewhere, or lower "
            "health.min_checkpoint_free_gb",
        )
    return CheckResult(
        "checkpoint_disk",
        Status.PASS,
        f"{existing} {free / GB:.1f} GB free, writable; needs {need / GB:.2f} GB "
        f"(health.min_checkpoint_free_gb); {unknown}",
    )


# --- etcd and the clock -----------------------------------------------------------------------


def check_etcd_and_clock(
    cfg: HealthConfig, endpoints: list[str], security: EtcdSecurity = INSECURE
) -> list[CheckResult]:
    """Each etcd endpoint's /health, and this node's wall clock against the server's.

    With TLS (``security``) /health is read over HTTPS, with the CA, the client certificate and
    the server name the gRPC client uses, so a certificate problem shows here too.

    The server's clock comes from the HTTP ``Date`` header, whole seconds: the true offset lies
    in ``[sent - date - 1, received - date]``, and the clock fails only when that whole interval
    is beyond ``max_clock_skew_s``.
    """
    if not endpoints:
        return [_embedded_etcd(cfg), _clock_alone()]
    healthy, problems, offsets = [], [], []
    context = None
    if security.tls:
        try:
            context = security.ssl_context()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            return [
                CheckResult(
                    "etcd",
                    Status.FAIL,
                    f"cluster.etcd_tls: cannot load the CA or the client certificate ({exc}). "
                    "Fix: point cluster.etcd_tls.ca / cert / key at readable PEM files, the key "
                    "matching the certificate",
                ),
                _clock_against(cfg, []),
            ]
    for endpoint in endpoints:
        host, port = endpoint.removeprefix("http://").rsplit(":", 1)
        if context is None:
            url = f"http://{host}:{port}/health"
            opener = urllib.request.urlopen
        else:  # the address as configured, the certificate checked for the gRPC client's name
            url = f"https://{security.target_name(endpoints)}:{port}/health"
            opener = _opener_to(host, context)
        sent = time.time()
        try:
            with opener(url, timeout=cfg.etcd_timeout_s) as resp:
                body = json.loads(resp.read())
                received = time.time()
                date = resp.headers.get("Date")
        except (OSError, ValueError) as exc:
            problems.append(f"{endpoint}: {getattr(exc, 'reason', exc)}")
            continue
        if str(body.get("health")) != "true":
            problems.append(f"{endpoint}: unhealthy ({body.get('reason') or body})")
            continue
        healthy.append(f"{endpoint} {1000 * (received - sent):.0f} ms")
        if date:
            server = email.utils.parsedate_to_datetime(date).timestamp()
            offsets.append((sent - server - 1, received - server))
    if not healthy:
        etcd = CheckResult(
            "etcd",
            Status.FAIL,
            f"no etcd endpoint is healthy ({'; '.join(problems)}). Fix: check "
            "cluster.etcd_endpoints and that the etcd cluster is up and reachable from this node",
        )
    elif problems:
        etcd = CheckResult(
            "etcd",
            Status.WARN,
            f"{len(healthy)}/{len(endpoints)} endpoints healthy ({', '.join(healthy)}); "
            f"{'; '.join(problems)}. Fix: repair or remove the dead member from "
            "cluster.etcd_endpoints",
        )
    else:
        etcd = CheckResult("etcd", Status.PASS, "healthy: " + ", ".join(healthy))
    return [etcd, _clock_against(cfg, offsets)]


def _opener_to(host: str, context: ssl.SSLContext) -> Callable[..., Any]:
    """``urlopen`` over HTTPS that connects to ``host`` whatever the URL's host.

    The URL names the server as its certificate must (the gRPC client's target name); the socket
    goes to the endpoint's address."""

    class Connection(http.client.HTTPSConnection):
        def connect(self) -> None:
            sock = socket.create_connection((host, self.port), self.timeout)
            self.sock = context.wrap_socket(sock, server_hostname=self.host)

    class Handler(urllib.request.HTTPSHandler):
        def https_open(self, req: urllib.request.Request) -> Any:
            return self.do_open(Connection, req)

    return urllib.request.build_opener(Handler(context=context)).open


def check_etcd_certificates(cfg: HealthConfig, security: EtcdSecurity) -> list[CheckResult]:
    """Days left on the etcd CA and this node's client certificate (``cluster.etcd_tls``).

    A warning under ``health.cert_warn_days``, a failure once one has expired (or is not yet
    valid). Nothing without TLS."""
    if not security.tls:
        return []
    from cryptography import x509

    now = time.time()
    worst, parts, fixes = Status.PASS, [], []
    for key, path in (("ca", security.ca), ("cert", security.cert)):
        if not path:
            continue
        setting = f"cluster.etcd_tls.{key}"
        try:
            with open(path, "rb") as f:
                certs = x509.load_pem_x509_certificates(f.read())
        except (OSError, ValueError) as exc:
            return [
                CheckResult(
                    "etcd_certs",
                    Status.FAIL,
                    f"{setting}={path!r}: not a readable PEM certificate ({exc}). Fix: point "
                    f"{setting} at the PEM file",
                )
            ]
        for cert in certs[:1]:  # the certificate itself; a chain's CAs are the CA's business
            ends = cert.not_valid_after_utc.timestamp()
            starts = cert.not_valid_before_utc.timestamp()
            days = (ends - now) / 86400
            subject = cert.subject.rfc4514_string()
            parts.append(f"{setting} ({subject}) expires {_utc(ends)}, in {days:.0f} days")
            if ends <= now or starts > now:
                worst = Status.FAIL
                when = "expired" if ends <= now else f"is not valid before {_utc(starts)}"
                fixes.append(f"{setting} {when}: renew it")
            elif days < cfg.cert_warn_days:
                worst = worst if worst is Status.FAIL else Status.WARN
                fixes.append(
                    f"{setting} expires within health.cert_warn_days={cfg.cert_warn_days}: renew "
                    "it before then"
                )
    message = "; ".join(parts)
    if fixes:
        message += ". Fix: " + "; ".join(fixes) + " (the new files take effect at the next start)"
    return [CheckResult("etcd_certs", worst, message)]


def _embedded_etcd(cfg: HealthConfig) -> CheckResult:
    try:
        binary = etcd_binary()
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (FileNotFoundError, subprocess.SubprocessError, OSError) as exc:
        return CheckResult(
            "etcd",
            Status.FAIL,
            f"no cluster.etcd_endpoints and the embedded etcd cannot start ({exc})",
        )
    version = out.splitlines()[0] if out else "?"
    return CheckResult(
        "etcd", Status.PASS, f"no cluster.etcd_endpoints: the embedded {binary} runs ({version})"
    )


def _clock_alone() -> CheckResult:
    now = time.time()
    if now < SANE_EPOCH:
        return _clock_unset(now)
    return CheckResult(
        "clock",
        Status.PASS,
        f"wall clock {_utc(now)}; no etcd server to compare with",
    )


def _clock_against(cfg: HealthConfig, offsets: list[tuple[float, float]]) -> CheckResult:
    now = time.time()
    if now < SANE_EPOCH:
        return _clock_unset(now)
    if not offsets:
        return CheckResult("clock", Status.WARN, f"wall clock {_utc(now)}; etcd sent no Date")
    low, high = max(o[0] for o in offsets), min(o[1] for o in offsets)
    skew = low if low > 0 else high if high < 0 else 0.0
    if abs(skew) > cfg.max_clock_skew_s:
        return CheckResult(
            "clock",
            Status.FAIL,
            f"this node's clock is {skew:+.1f} s off etcd's, beyond "
            f"health.max_clock_skew_s={cfg.max_clock_skew_s}. Fix: synchronise it "
            "(chronyc makestep, or enable NTP: timedatectl set-ntp true)",
        )
    return CheckResult(
        "clock",
        Status.PASS,
        f"within {max(abs(low), abs(high)):.1f} s of etcd's "
        f"(health.max_clock_skew_s={cfg.max_clock_skew_s})",
    )


def _clock_unset(now: float) -> CheckResult:
    return CheckResult(
        "clock",
        Status.FAIL,
        f"the wall clock reads {_utc(now)}, before {_utc(SANE_EPOCH)}: it was never set. "
        "Fix: set it and enable NTP (timedatectl set-ntp true)",
    )


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


# --- the job ----------------------------------------------------------------------------------


def check_job(cfg: Config) -> CheckResult:
    """Check that the job's class (``job._target_``) imports on this node and is a whole Job.

    The launcher checked it where it ran. A node without the job's package (not installed, not
    on PYTHONPATH) would start workers that fail at once, again and again."""
    try:
        cls = job_class(cfg.job.get("_target_", ""))
    except ConfigError as exc:
        return CheckResult("job", Status.FAIL, f"on this node, {exc}")
    return CheckResult("job", Status.PASS, f"{cls.__module__}.{cls.__qualname__} imports")


# --- all together -----------------------------------------------------------------------------


def run_checks(
    cfg: Config,
    node_id: str,
    endpoints: list[str],
    slots: int,
    device: str,
    *,
    size_model: bool = True,
) -> HealthReport:
    """Every check for this node, as the agent runs them before joining and the doctor prints.

    ``slots`` and ``device`` are what the agent will start
    (:func:`launcher.agent.slots.local_slots`).
    ``size_model``: before the job's first checkpoint, size one by building the job's model on
    the meta device. The agent does, to know the disk it needs; the doctor passes False, checks free
    space against ``health.min_checkpoint_free_gb`` alone, and so loads no torch on a CPU node.
    """
    started = time.monotonic()
    h = cfg.health
    try:  # the certificates; the password is the etcd client's business
        security = etcd_security(cfg.cluster, with_password=False)
    except EtcdRefused as exc:
        security = INSECURE
        tls_results = [CheckResult("etcd_certs", Status.FAIL, str(exc))]
    else:
        tls_results = check_etcd_certificates(h, security)
    job = check_job(cfg)
    results = [
        job,
        check_open_files(h),
        check_stack(h),
        check_shm(h, required=device == "cuda" or cfg.data.loader_workers > 0),
        # A job that does not import here cannot be sized: the floor alone, as the doctor's.
        check_checkpoint_disk(cfg, size_model and job.status is Status.PASS),
        *check_etcd_and_clock(h, endpoints, security),
        *tls_results,
        *gpu_checks(cfg, slots, device),
    ]
    return HealthReport(
        node_id, socket.getfqdn(), time.time(), time.monotonic() - started, tuple(results)
    )
