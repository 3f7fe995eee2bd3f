"""etcd security against a real etcd: TLS with client certificates, user auth, refusals.

One etcd for the module, started with certificates generated here (a CA, a server certificate
for 127.0.0.1/localhost, client certificates) and ``--client-cert-auth``, then with auth enabled:
``root``, and a user ``job`` whose role may read and write only the test's job prefix. Its simple
tokens live 2 s (``--auth-token-ttl``), so that the clients' re-authentication runs within the
test. Skipped without the etcd binary.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from elastic.config import ClusterConfig, Config, EtcdTlsConfig, HealthConfig
from launcher.health.checks import check_etcd_and_clock, check_etcd_certificates
from launcher.health.node_report import Status
from launcher.rendezvous.credentials import credential_problems, etcd_security_problems
from launcher.rendezvous.embedded_etcd import etcd_binary, free_port
from launcher.rendezvous.etcd import EtcdRefused, EtcdSecurity, connect
from launcher.rendezvous.etcd_client import EtcdDenied
from launcher.rendezvous.membership import NodeRecord
from launcher.rendezvous.rendezvous import Rendezvous
from tests.conftest import FAST, REPO

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

PREFIX = "/elastic"
JOBS = "secure-"  # the job user may use every job whose id starts so
PASSWORD = "job-secret"
TOKEN_TTL_S = 2


# --- certificates -------------------------------------------------------------------------------


@dataclass
class Issuer:
    name: x509.Name
    key: ec.EllipticCurvePrivateKey


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> Path:
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path.with_suffix(".pem")


def _cert(
    path: Path,
    common_name: str,
    issuer: Issuer | None,
    *,
    ca: bool = False,
    server: bool = False,
    valid_days: float = 30,
) -> tuple[Path, Issuer]:
    """A certificate (self-signed without ``issuer``) and its key, at ``path`` .pem/.key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    signer = issuer or Issuer(name, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH] + (
        [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(signer.name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=valid_days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if server:
        san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = builder.sign(signer.key, hashes.SHA256())
    return _write(path, key, cert), Issuer(name, key)


@dataclass
class Pki:
    ca: Path
    client: Path  # .pem, its key beside it as .key
    soon: Path  # a client certificate that expires in 3 days
    expired: Path
    rogue_ca: Path  # a CA etcd does not trust
    rogue_client: Path  # a client certificate signed by it


def make_pki(root: Path) -> tuple[Pki, Path]:
    ca, issuer = _cert(root / "ca", "test-ca", None, ca=True)
    server, _ = _cert(root / "server", "etcd", issuer, server=True)
    client, _ = _cert(root / "client", "elastic-node", issuer)
    soon, _ = _cert(root / "soon", "elastic-node", issuer, valid_days=3)
    expired, _ = _cert(root / "expired", "elastic-node", issuer, valid_days=-0.5)
    rogue_ca, rogue = _cert(root / "rogue-ca", "rogue-ca", None, ca=True)
    rogue_client, _ = _cert(root / "rogue-client", "elastic-node", rogue)
    return Pki(ca, client, soon, expired, rogue_ca, rogue_client), server


# --- a secured etcd ------------------------------------------------------------------------------


@dataclass
class SecureEtcd:
    endpoint: str
    pki: Pki
    ctl: list[str]  # etcdctl as root, over TLS with the client certificate

    def security(self, **changes: str) -> EtcdSecurity:
        base = EtcdSecurity(
            ca=str(self.pki.ca),
            cert=str(self.pki.client),
            key=str(self.pki.client.with_suffix(".key")),
            user="job",
            password=PASSWORD,
        )
        return replace(base, **changes)

    def keys(self, prefix: str) -> list[str]:
        out = subprocess.run(
            [*self.ctl, "get", "--prefix", "--keys-only", prefix],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [line for line in out.splitlines() if line]


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    try:
        binary = etcd_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    etcdctl = Path(binary).with_name("etcdctl")
    if not etcdctl.exists() and not shutil.which("etcdctl"):
        pytest.skip("no etcdctl beside the etcd binary")
    root = tmp_path_factory.mktemp("secure-etcd")
    pki, server = make_pki(root)
    client_port, peer_port = free_port(), free_port()
    client_url, peer_url = f"https://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    log = open(root / "etcd.log", "wb")  # noqa: SIM115 - closed at the end
    proc = subprocess.Popen(
        [
            binary,
            "--name=secure",
            f"--data-dir={root / 'data'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=secure={peer_url}",
            f"--cert-file={server}",
            f"--key-file={server.with_suffix('.key')}",
            f"--trusted-ca-file={pki.ca}",
            "--client-cert-auth",
            "--auth-token=simple",
            f"--auth-token-ttl={TOKEN_TTL_S}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    ctl = [
        str(etcdctl) if etcdctl.exists() else "etcdctl",
        f"--endpoints={client_url}",
        f"--cacert={pki.ca}",
        f"--cert={pki.client}",
        f"--key={pki.client.with_suffix('.key')}",
        "--dial-timeout=2s",
    ]
    try:
        deadline = time.monotonic() + 15
        while subprocess.run([*ctl, "endpoint", "health"], capture_output=True).returncode:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"the TLS etcd did not start: {(root / 'etcd.log').read_text()[-2000:]}"
                )
            time.sleep(0.1)
        for args in (
            ["user", "add", "root", "--new-user-password=root-secret"],
            ["user", "grant-role", "root", "root"],
            ["user", "add", "job", f"--new-user-password={PASSWORD}"],
            ["role", "add", "job"],
            ["role", "grant-permission", "job", "readwrite", "--prefix=true", f"{PREFIX}/{JOBS}"],
            ["user", "grant-role", "job", "job"],
            ["auth", "enable"],
        ):
            subprocess.run([*ctl, *args], capture_output=True, check=True)
        yield SecureEtcd(f"127.0.0.1:{client_port}", pki, [*ctl, "--user=root:root-secret"])
    finally:
        proc.kill()
        proc.wait()
        log.close()


@pytest.fixture
def job() -> str:
    return JOBS + uuid.uuid4().hex[:8]


def _wait(predicate, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _node(etcd: SecureEtcd, job: str, name: str, port: int) -> Rendezvous:
    client = connect([etcd.endpoint], security=etcd.security())
    return Rendezvous(
        client,
        job_id=job,
        node=NodeRecord(name, "127.0.0.1", port, 1),
        cfg=FAST,
        min_nodes=1,
        max_nodes=2,
    )


# --- joining over TLS with a user ----------------------------------------------------------------


def test_nodes_join_keep_their_lease_and_watch_over_tls_with_auth(
    secure_etcd: SecureEtcd, job: str
) -> None:
    """A node joins, keeps its lease past two TTLs while its token expires, re-authenticates,
    and learns by watch that a second node joined (a new round with both)."""
    first = _node(secure_etcd, job, "n1", 1001)
    second = _node(secure_etcd, job, "n2", 1002)
    try:
        first.join()
        first.record.set_ready()
        assert _wait(lambda: first.view.round is not None and first.view.round.member("n1"), 5)
        time.sleep(2 * FAST.lease_ttl_s + 0.5)  # two lease TTLs; the token's TTL runs out too
        assert not first.fenced.is_set()
        assert not first.etcd_lost.is_set()
        assert f"{PREFIX}/{job}/nodes/n1" in secure_etcd.keys(f"{PREFIX}/{job}/nodes/")
        second.join()
        second.record.set_ready()

        def both() -> bool:
            rnd = first.view.round
            return rnd is not None and rnd.world_size == 2

        assert _wait(both, 10), first.view
        assert not first.fenced.is_set() and not second.fenced.is_set()
    finally:
        first.leave()
        second.leave()
    assert _wait(lambda: not secure_etcd.keys(f"{PREFIX}/{job}/nodes/"), 3)


def test_an_expired_token_and_a_changed_auth_store_are_renewed(
    secure_etcd: SecureEtcd, job: str
) -> None:
    client = connect([secure_etcd.endpoint], security=secure_etcd.security())
    key = f"{PREFIX}/{job}/probe"
    client.put(key, "1")
    time.sleep(TOKEN_TTL_S + 1)  # etcd forgot the token
    client.put(key, "2")
    # Any change of users or roles makes every older token's auth revision stale.
    subprocess.run([*secure_etcd.ctl, "role", "add", "unrelated"], capture_output=True, check=True)
    assert client.get(key)[0] == b"2"
    client.delete(key)


# --- refusals -------------------------------------------------------------------------------------


def test_a_wrong_password_is_refused_and_nothing_joins(
    secure_etcd: SecureEtcd, tmp_path: Path, job: str
) -> None:
    with pytest.raises(EtcdRefused) as refused:
        connect([secure_etcd.endpoint], security=secure_etcd.security(password="wrong"))
    message = str(refused.value)
    assert "cluster.etcd_user" in message and "cluster.etcd_password_file" in message

    # The whole launcher: refused before anything starts, no traceback, no key.
    password = tmp_path / "password"
    password.write_text("wrong\n")
    key = secure_etcd.pki.client.with_suffix(".key")
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_ETCD_PASSWORD"}
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher",
            "cluster=bare_metal",
            f"job_id={job}",
            f"run_dir={tmp_path / 'run'}",
            f"cluster.etcd_endpoints=[{secure_etcd.endpoint}]",
            f"cluster.etcd_tls.ca={secure_etcd.pki.ca}",
            f"cluster.etcd_tls.cert={secure_etcd.pki.client}",
            f"cluster.etcd_tls.key={key}",
            "cluster.etcd_user=job",
            f"cluster.etcd_password_file={password}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert launched.returncode != 0
    assert "Traceback" not in launched.stderr + launched.stdout
    assert "cluster.etcd_password_file" in launched.stderr, launched.stderr
    assert not secure_etcd.keys(f"{PREFIX}/{job}")


def _agent_refused(etcd: SecureEtcd, cfg: Config, tmp_path: Path) -> str:
    """Run an agent of ``cfg`` (user ``job``, its password in the environment): it must leave
    unhealthy; its event log."""
    from launcher.agent.agent import EXIT_UNHEALTHY, Agent

    os.environ["ELASTIC_ETCD_PASSWORD"] = PASSWORD
    try:
        agent = Agent(cfg, str(tmp_path / "config.yaml"), "n9", "127.0.0.1", [etcd.endpoint])
        assert agent.run() == EXIT_UNHEALTHY
    finally:
        del os.environ["ELASTIC_ETCD_PASSWORD"]
    return next((tmp_path / "run").rglob("*.jsonl")).read_text()


def test_a_node_without_a_client_certificate_is_refused_and_does_not_join(
    secure_etcd: SecureEtcd, tmp_path: Path, job: str
) -> None:
    """The agent itself: it exits with EXIT_UNHEALTHY, says why, and writes nothing."""
    from elastic import config

    cfg = config.Config(job_id=job, run_dir=str(tmp_path / "run"))
    cfg.cluster.etcd_endpoints = [secure_etcd.endpoint]
    cfg.cluster.etcd_tls = EtcdTlsConfig(ca=str(secure_etcd.pki.ca))
    cfg.cluster.etcd_user = "job"
    log = _agent_refused(secure_etcd, cfg, tmp_path)
    assert "requires a client certificate" in log and "cluster.etcd_tls.cert" in log
    assert not secure_etcd.keys(f"{PREFIX}/{job}")


def test_a_job_outside_the_users_role_is_refused_at_once_not_after_the_grace_period(
    secure_etcd: SecureEtcd, tmp_path: Path
) -> None:
    """Valid credentials, but the role covers other jobs' keys: etcd answers PERMISSION_DENIED,
    which no retry changes, so the agent leaves unhealthy with the fix instead of waiting out
    ``rendezvous.etcd_grace_s`` as if etcd were away."""
    from elastic import config

    outside = "other-" + uuid.uuid4().hex[:8]
    with pytest.raises(EtcdDenied, match="grant-permission ROLE readwrite"):
        _node(secure_etcd, outside, "n1", 1001).join()

    cfg = config.Config(job_id=outside, run_dir=str(tmp_path / "run"))
    cfg.cluster.etcd_endpoints = [secure_etcd.endpoint]
    cfg.cluster.etcd_tls = EtcdTlsConfig(
        ca=str(secure_etcd.pki.ca),
        cert=str(secure_etcd.pki.client),
        key=str(secure_etcd.pki.client.with_suffix(".key")),
    )
    cfg.cluster.etcd_user = "job"
    cfg.rendezvous.etcd_grace_s = 30.0  # a denial taken for an outage would exit 4 after this
    log = _agent_refused(secure_etcd, cfg, tmp_path)
    assert "etcd denied n9" in log and "rendezvous.prefix" in log


def test_untrusted_certificates_are_refused_with_the_setting_to_fix(
    secure_etcd: SecureEtcd, job: str
) -> None:
    rogue = secure_etcd.pki.rogue_client
    cases = {
        "cluster.etcd_tls.ca": secure_etcd.security(ca=str(secure_etcd.pki.rogue_ca)),
        "cluster.etcd_tls.cert": secure_etcd.security(
            cert=str(rogue), key=str(rogue.with_suffix(".key"))
        ),
        "cluster.etcd_tls.server_name": secure_etcd.security(server_name="etcd.elsewhere"),
    }
    for setting, security in cases.items():
        with pytest.raises(EtcdRefused) as refused:
            connect([secure_etcd.endpoint], timeout_s=2, security=security)
        assert setting in str(refused.value), (setting, str(refused.value))
    with pytest.raises(EtcdRefused, match="cluster.etcd_tls.ca is not set"):
        connect([secure_etcd.endpoint], timeout_s=2)


# --- the health check ----------------------------------------------------------------------------


def test_the_health_check_reads_etcd_over_tls_and_reports_certificate_expiry(
    secure_etcd: SecureEtcd, job: str
) -> None:
    health = HealthConfig(cert_warn_days=14)
    etcd, _clock = check_etcd_and_clock(health, [secure_etcd.endpoint], secure_etcd.security())
    assert etcd.status is Status.PASS, etcd.message

    def certs(pem: Path) -> tuple[Status, str]:
        security = secure_etcd.security(cert=str(pem), key=str(pem.with_suffix(".key")))
        [result] = check_etcd_certificates(health, security)
        return result.status, result.message

    status, message = certs(secure_etcd.pki.client)
    assert status is Status.PASS and "cluster.etcd_tls.ca" in message, message
    status, message = certs(secure_etcd.pki.soon)
    assert status is Status.WARN and "in 3 days" in message and "renew" in message, message
    status, message = certs(secure_etcd.pki.expired)
    assert status is Status.FAIL and "cluster.etcd_tls.cert expired" in message, message
    assert check_etcd_certificates(health, EtcdSecurity()) == []


def test_the_torchrun_backend_speaks_tls_and_auth_and_refuses_without(
    secure_etcd: SecureEtcd, tmp_path: Path, job: str
) -> None:
    """``torchrun --rdzv-backend=etcd-v3 --rdzv-conf ca=...,cert=...,key=...,user=job,
    password_file=...``: the rendezvous state is written and read back over TLS as the user; no
    wrong password is refused, naming the settings; a password on the command line and a missing
    key file are refused before connecting."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousParameters,
    )

    from launcher.torchrun.backend import create_backend

    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    tls = {
        "ca": str(secure_etcd.pki.ca),
        "cert": str(secure_etcd.pki.client),
        "key": str(secure_etcd.pki.client.with_suffix(".key")),
    }

    def params(**conf: str) -> RendezvousParameters:
        return RendezvousParameters(
            "etcd-v3", secure_etcd.endpoint, job, 1, 1, key_prefix=PREFIX, **conf
        )

    backend, _ = create_backend(params(**tls, user="job", password_file=str(secret)))
    assert backend.get_state() is None
    state, token, written = backend.set_state(b"round 0", None)
    assert written and state == b"round 0" and backend.get_state() == (state, token)
    assert secure_etcd.keys(f"{PREFIX}/{job}/") == [f"{PREFIX}/{job}/state"]

    wrong = tmp_path / "wrong"
    wrong.write_text("wrong\n")
    with pytest.raises(RendezvousConnectionError, match="refused user .job.*--rdzv-conf"):
        create_backend(params(**tls, user="job", password_file=str(wrong)))
    with pytest.raises(ValueError, match="process list.*password_file"):
        create_backend(params(**tls, user="job", password=PASSWORD))
    with pytest.raises(ValueError, match="--rdzv-conf key="):
        create_backend(params(**tls | {"key": str(tmp_path / "missing.key")}))


def test_health_over_plain_http_still_works_without_tls() -> None:
    # No etcd at all: the check fails as before, by address, without TLS.
    port = free_port()
    etcd, _ = check_etcd_and_clock(HealthConfig(etcd_timeout_s=0.5), [f"127.0.0.1:{port}"])
    assert etcd.status is Status.FAIL and f"127.0.0.1:{port}" in etcd.message


# --- settings ------------------------------------------------------------------------------------


def test_security_settings_are_checked_before_connecting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ELASTIC_ETCD_PASSWORD", raising=False)
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    external = ["10.0.0.1:2379"]

    def problems(**kw: object) -> str:
        tls = EtcdTlsConfig(**{k: v for k, v in kw.items() if k in ("ca", "cert", "key")})
        other = {k: v for k, v in kw.items() if k not in ("ca", "cert", "key")}
        c = ClusterConfig(**{"etcd_endpoints": external, **other}, etcd_tls=tls)  # type: ignore[arg-type]
        return "\n".join(etcd_security_problems(c))

    assert problems() == ""
    assert problems(ca=str(pem), cert=str(pem), key=str(pem)) == ""
    assert "cluster.etcd_tls.ca='/nope.pem': not a readable file" in problems(ca="/nope.pem")
    found = problems(ca=str(pem), cert=str(pem))
    assert "cluster.etcd_tls.cert" in found and "set cluster.etcd_tls.key too" in found
    assert "needs the CA" in problems(cert=str(pem), key=str(pem))
    found = problems(etcd_user="job")
    assert "cluster.etcd_password_file" in found and "ELASTIC_ETCD_PASSWORD" in found
    monkeypatch.setenv("ELASTIC_ETCD_PASSWORD", "x")
    assert problems(etcd_user="job") == ""
    assert "not a readable file" in problems(etcd_user="job", etcd_password_file="/nope")
    assert "embedded etcd" in problems(ca=str(pem), etcd_endpoints=[])
    # The torchrun backend checks the same rules, naming its own settings.
    torchrun = "\n".join(
        credential_problems("", str(pem), "", "", "", "/pw", lambda n: f"--rdzv-conf {n}")
    )
    assert "set --rdzv-conf key too" in torchrun and "set --rdzv-conf ca=" in torchrun
    assert "a password without --rdzv-conf user" in torchrun and "cluster." not in torchrun
