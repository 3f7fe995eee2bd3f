"""The etcd credentials' rules, checked before any connection, and where the password comes from.

One set of rules (:func:`credential_problems`) for both front ends that reach an external etcd:
the launcher's ``cluster.etcd_tls.*``/``cluster.etcd_user`` (:func:`etcd_security_problems`,
run with the config's own rules by :func:`launcher.compose.validate_launch` and again by
:func:`launcher.rendezvous.etcd.etcd_security`), and torchrun's ``--rdzv-conf`` settings
(:mod:`launcher.torchrun.backend`). Each names the settings in its own vocabulary:
:data:`OUR_NAMES` and :data:`TORCHRUN_NAMES` (which connection errors use too).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from elastic.config import ClusterConfig, problem

ETCD_PASSWORD_ENV = "ELASTIC_ETCD_PASSWORD"

# Each credential setting (torchrun's rdzv_conf key) and its name in our configuration.
CLUSTER_NAMES = {
    "ca": "cluster.etcd_tls.ca",
    "cert": "cluster.etcd_tls.cert",
    "key": "cluster.etcd_tls.key",
    "server_name": "cluster.etcd_tls.server_name",
    "user": "cluster.etcd_user",
    "password_file": "cluster.etcd_password_file",
}


def rdzv_conf_name(setting: str) -> str:
    """A setting as torchrun's user writes it (``--rdzv-conf ca=...``)."""
    return f"--rdzv-conf {setting}"


# Every etcd setting a message may name, in each front end's words: ours, and torchrun's.
OUR_NAMES = {"endpoints": "cluster.etcd_endpoints", **CLUSTER_NAMES}
TORCHRUN_NAMES = {"endpoints": "--rdzv-endpoint", **{s: rdzv_conf_name(s) for s in CLUSTER_NAMES}}


def _readable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.R_OK)


def credential_problems(
    ca: str,
    cert: str,
    key: str,
    server_name: str,
    user: str,
    password_file: str,
    name: Callable[[str], str],
) -> list[str]:
    """What is wrong with a set of etcd credentials, before any connection.

    The problems: a file that cannot be read, a certificate without its key, TLS settings without
    the CA, a password without a user, a user without a password source. ``name`` spells each
    setting as the user wrote it: ``ca`` is ``cluster.etcd_tls.ca`` to the launcher,
    ``rdzv_conf ca`` under torchrun. So both front ends share one set of rules, and each names its
    own keys."""
    problems: list[str] = []
    for setting, path in (("ca", ca), ("cert", cert), ("key", key)):
        if path and not _readable(path):
            problems.append(
                problem(
                    name(setting),
                    path,
                    "not a readable file",
                    f"point {name(setting)} at the PEM file (readable by this user)",
                )
            )
    if bool(cert) != bool(key):
        have, missing = ("cert", "key") if cert else ("key", "cert")
        problems.append(
            problem(
                name(have),
                cert or key,
                f"a client certificate needs both cert and key, and {name(missing)} is not set",
                f"set {name(missing)} too, or neither (server-auth TLS with {name('ca')} alone)",
            )
        )
    if (cert or server_name) and not ca:
        problems.append(
            problem(
                name("ca"),
                "",
                "TLS to etcd needs the CA that signed the etcd members' certificates",
                f"set {name('ca')}=/path/to/ca.pem",
            )
        )
    if password_file and not user:
        problems.append(
            problem(
                name("password_file"),
                password_file,
                f"a password without {name('user')}",
                f"set {name('user')}=<the etcd user>",
            )
        )
    if user and password_file and not _readable(password_file):
        problems.append(
            problem(
                name("password_file"),
                password_file,
                "not a readable file",
                f"point {name('password_file')} at a file holding the etcd user's password "
                "(chmod 600), readable by this user",
            )
        )
    elif user and not password_file and not os.environ.get(ETCD_PASSWORD_ENV):
        problems.append(
            problem(
                name("password_file"),
                "",
                f"{name('user')}={user!r} needs a password, and neither this setting nor "
                f"${ETCD_PASSWORD_ENV} is set",
                f"set {name('password_file')}=/path/to/password (chmod 600), or export "
                f"{ETCD_PASSWORD_ENV} in the launcher's environment",
            )
        )
    return problems


def etcd_security_problems(c: ClusterConfig) -> list[str]:
    """What is wrong with the etcd TLS and user settings of ``c``.

    :func:`credential_problems` of ``cluster.etcd_tls`` and the etcd user, and TLS or a user set for
    the embedded etcd (which is plaintext and has no users)."""
    tls, external = c.etcd_tls, bool(c.etcd_endpoints)
    # A user for the embedded etcd is refused below; its password is then beside the point.
    ignored = c.etcd_user and not external
    user, password_file = ("", "") if ignored else (c.etcd_user, c.etcd_password_file)
    problems = credential_problems(
        tls.ca, tls.cert, tls.key, tls.server_name, user, password_file, CLUSTER_NAMES.__getitem__
    )
    if not external and (tls.ca or c.etcd_user):
        key = "cluster.etcd_tls.ca" if tls.ca else "cluster.etcd_user"
        problems.append(
            problem(
                key,
                tls.ca or c.etcd_user,
                "without cluster.etcd_endpoints the job runs an embedded etcd, which is plaintext "
                "and has no users",
                "set cluster.etcd_endpoints to the secured etcd cluster, or unset "
                "cluster.etcd_tls.* and cluster.etcd_user",
            )
        )
    return problems


def read_password(password_file: str) -> str:
    """The etcd user's password, from ``password_file`` or ``$ELASTIC_ETCD_PASSWORD``.

    It is the content of ``password_file`` without its trailing line end, or, with no file named,
    ``$ELASTIC_ETCD_PASSWORD`` ("" when unset). Never a command-line argument, which the process
    list shows. Raises OSError when the file cannot be read."""
    if not password_file:
        return os.environ.get(ETCD_PASSWORD_ENV, "")
    with open(password_file) as f:
        return f.read().rstrip("\r\n")
