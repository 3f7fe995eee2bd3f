"""What a running job writes to etcd: revisions per hour, by key, and the database's size.

Starts an etcd of its own (compaction off, so the whole history can be read back), runs the
local job on it (``python -m launcher`` with ``cluster.etcd_endpoints`` pointing there), reads
etcd's revision and size before and after (:func:`launcher.rendezvous.etcd_usage.usage`), then
replays the history to count the revisions each key took. Prints revisions per hour over the
whole run (start-up and end included) and while training (the ``progress`` key's puts, over
the span their ``published_at`` covers). About a minute and a half on two cores::

    .venv/bin/python bench/etcd_writes.py
    .venv/bin/python bench/etcd_writes.py --work-dir /tmp/etcd-writes trainer.epochs=4
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launcher.rendezvous.embedded_etcd import EmbeddedEtcd  # noqa: E402
from launcher.rendezvous.etcd import connect  # noqa: E402
from launcher.rendezvous.etcd_usage import MB, revisions_per_hour, usage  # noqa: E402

JOB_ID = "etcd-writes"
BASE = f"/elastic/{JOB_ID}"  # rendezvous.prefix's default, and the job


def history(client: Any, first: int, last: int) -> list[tuple[str, int, bytes]]:
    """Every change (key, revision, value) from revision ``first`` to ``last``, by a watch."""
    changes: list[tuple[str, int, bytes]] = []
    done = threading.Event()

    def seen(response: Any) -> None:
        for e in getattr(response, "events", ()):  # an error instead ends the wait below
            changes.append((e.key.decode(), e.mod_revision, e.value))
            if e.mod_revision >= last:
                done.set()

    watch = client.add_watch_callback(b"\0", seen, range_end=b"\0", start_revision=first)
    if not done.wait(60):
        raise TimeoutError(f"the history up to revision {last} did not arrive within 60 s")
    client.cancel_watch(watch)
    return changes


def group(key: str) -> str:
    """``progress``, ``nodes``, ``.health/reports``, ...: the key below the job, without ids."""
    rest = key.removeprefix(BASE).lstrip("/")
    parts = rest.split("/")
    return "/".join(parts[:2]) if parts[0].startswith(".") else parts[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, help="keep the run here (default: a temp dir)")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory(prefix="bench-etcd-writes-") as tmp:
        work = args.work_dir or Path(tmp)
        with EmbeddedEtcd(work / "etcd", work / "etcd.log", compaction_retention="0") as etcd:
            client = connect(etcd.endpoints)
            before, began = usage(client), time.monotonic()
            job = subprocess.run(
                [sys.executable, "-m", "launcher", "trainer.epochs=2", f"run_dir={work / 'run'}",
                 f"job_id={JOB_ID}", f"cluster.etcd_endpoints=[{etcd.endpoint}]", *overrides],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            seconds = time.monotonic() - began
            after = usage(client)
            changes = history(client, before.revision + 1, after.revision)
    if job.returncode:
        sys.exit(f"the job failed (exit {job.returncode}); see {work / 'run'}")
    by_key: dict[str, set[int]] = collections.defaultdict(set)
    for key, revision, _ in changes:
        by_key[group(key)].add(revision)
    written = after.revision - before.revision
    print(f"job:      {seconds:.0f} s, {written} revisions, ", end="")
    print(f"{revisions_per_hour(before, after, seconds):.0f} per hour over the whole run")
    for name, revisions in sorted(by_key.items(), key=lambda kv: -len(kv[1])):
        print(f"  {name:<16} {len(revisions)}")
    progress = f"{BASE}/progress"
    published = [json.loads(v)["published_at"] for k, _, v in changes if k == progress and v]
    if len(published) > 1:
        span = published[-1] - published[0]
        rate = (len(published) - 1) * 3600 / span
        print(f"training: {rate:.0f} progress revisions per hour ", end="")
        print(f"({len(published)} puts in {span:.0f} s)")
    print(f"database: {before.db_size / MB:.2f} MB before, {after.db_size / MB:.2f} MB after")


if __name__ == "__main__":
    main()
