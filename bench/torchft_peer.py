"""The torchft peer, driven from Python: a lighthouse and three replicas of torchft 0.2.0.

Each replica is a replica group of one process running bench/torchft_train.py: a node.
torchft is not a dependency of this project: the bench makes a venv of its own,
``.venv-torchft/``, on first use. It sees the running interpreter's site-packages through a
``.pth`` file, so torch is the project's, and pip adds torchft and its OpenTelemetry packages.

The lighthouse runs in a session of its own, as a job's coordinator would on a machine apart,
and no fault strikes it. A killed replica is not started again: what is measured is the
survivors' stall, and torchrun's dead agent is not replaced either. ``min_replica_size`` and
the lighthouse's ``min_replicas`` are 2, so two survivors go on. The quorum orders replicas by
``replica_id``, so node0 (replica 0) hosts the quorum's store, as node0 hosts torchrun's.

What a recovery waits on (torchft's manager.py and lighthouse): every step asks the lighthouse
for a quorum, which it grants at once while the previous quorum's replicas all ask. Once one
is missing, it waits until that replica's heartbeat is ``heartbeat_timeout_ms`` old. A fault
that lands in an all-reduce also fails it, and the step is not committed. A survivor may wait
out the gloo timeout first: always for a SIGSTOP, and for a SIGKILL when the other survivor
failed at once and left the op. The two rows:

- **torchft, defaults**: the lighthouse's defaults (``heartbeat_timeout_ms`` 5000,
  ``join_timeout_ms`` 60000, ``quorum_tick_ms`` 100) and the Manager's (``timeout`` 60 s,
  also ``ProcessGroupGloo``'s default; ``quorum_timeout`` 60 s; a heartbeat every 100 ms).
- **torchft, tuned**, as a careful user tunes it for fast recovery: ``heartbeat_timeout_ms``
  1000 (ten missed heartbeats), so a lost replica is dropped after 1 s; ``join_timeout_ms``
  1000, so a replica that heartbeats but does not ask for the quorum holds it 1 s, not a
  minute; and a 10 s Manager and gloo timeout, as torchrun's tuned row, so an all-reduce with
  a frozen replica fails. ``quorum_timeout`` stays 60 s: no recovery waits on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from peer_job import NODES, PeerJob, answers, free_port

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-torchft"
TORCHFT = "torchft==0.2.0"
TRAIN = Path(__file__).resolve().parent / "torchft_train.py"
LIGHTHOUSE_WAIT_S = 60.0  # the lighthouse must serve within this
MIN_REPLICAS = 2


@dataclass(frozen=True)
class TorchftSettings:
    """How the torchft peer runs: one row of a bench's table."""

    name: str
    lighthouse: list[str]  # torchft_lighthouse options beyond --bind and --min_replicas
    env: dict[str, str]  # the replicas' (bench/torchft_train.py's TIMEOUT_S)


DEFAULTS = TorchftSettings("torchft, defaults", [], {})
TUNED = TorchftSettings(
    "torchft, tuned",
    ["--heartbeat_timeout_ms=1000", "--join_timeout_ms=1000"],
    {"TIMEOUT_S": "10"},
)
TORCHFT_PEERS = [DEFAULTS, TUNED]


def torchft_python() -> Path:
    """The python of ``.venv-torchft``, made with torchft installed on first use.

    The project's own environment stays without torchft."""
    python = VENV / "bin" / "python"
    if any(VENV.glob(f"lib/python*/site-packages/{TORCHFT.replace('==', '-')}.dist-info")):
        return python
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    where = [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    site = Path(subprocess.run(where, check=True, capture_output=True, text=True).stdout.strip())
    (site / "project.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", TORCHFT], check=True)
    return python


class TorchftPeer(PeerJob):
    """A lighthouse and three torchft replicas of the peer job, each in its own session."""

    def __init__(
        self, work: Path, settings: TorchftSettings, *, steps: int, step_sleep: float
    ) -> None:
        super().__init__(work)
        self.settings = settings
        self.python = torchft_python()
        self.port = free_port()
        self.env = {
            **os.environ,
            **settings.env,
            "LOG_DIR": str(self.logs),
            "STEPS": str(steps),
            "STEP_SLEEP": f"{step_sleep:.3f}",
            "MIN_REPLICAS": str(MIN_REPLICAS),
            "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.port}",
        }
        self.lighthouse: subprocess.Popen[bytes] | None = None

    def start_all(self) -> None:
        """The lighthouse first, and the replicas once it serves."""
        argv = [
            str(self.python.parent / "torchft_lighthouse"),
            f"--bind=127.0.0.1:{self.port}",
            f"--min_replicas={MIN_REPLICAS}",
            *self.settings.lighthouse,
        ]
        self.lighthouse = self.spawn("lighthouse", argv, self.env)
        deadline = time.monotonic() + LIGHTHOUSE_WAIT_S
        while not answers(self.port):
            if time.monotonic() > deadline or self.lighthouse.poll() is not None:
                raise RuntimeError(f"no torchft lighthouse; see {self.work}/lighthouse.out")
            time.sleep(0.1)
        for replica, node in enumerate(NODES):
            env = {**self.env, "NODE_NAME": node, "REPLICA_ID": str(replica)}
            self.procs[node] = self.spawn(node, [str(self.python), str(TRAIN)], env)

    def stop(self) -> None:
        super().stop()
        if self.lighthouse is not None:
            self.lighthouse.kill()
            self.lighthouse.wait(timeout=30)
