"""The ``notify`` section: who is told when the job needs a person, and when.

A job runs for days unattended; its owner should learn of a quarantined node, a job that waits
for nodes, one that recovers again and again, and its end without looking. Each alert runs
``command`` and/or posts to ``webhook`` (:mod:`launcher.notify`); both empty (the default): off.
What is alerted and who sends it is :mod:`launcher.alerts`.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.config.schema import SECONDS, bounded


@dataclass
class NotifyConfig:
    """Alerts to the job's owner; ``command`` and ``webhook`` empty: none."""

    # A shell command (run by /bin/sh -c) that gets the alert's JSON on its stdin and its
    # summary in ELASTIC_ALERT_KIND, ELASTIC_ALERT_TEXT, ELASTIC_ALERT_JOB and ELASTIC_ALERT_NODE,
    # e.g. 'mail -s "$ELASTIC_ALERT_TEXT" me@example.com'.
    command: str = ""
    # An http(s) URL that gets the alert as a JSON POST: kind, job_id, node, text, ts and the
    # fields of the event behind it.
    webhook: str = ""
    # An alert when this many recoveries happen within an hour (then counting starts again).
    recoveries_per_hour: int = bounded(
        10, ge=1, fix="set notify.recoveries_per_hour=10 (recoveries within an hour)"
    )
    # An alert when the job has waited this long for nodes (fewer than cluster.min_nodes ready
    # after a round lost members); a node back sooner is no news.
    below_min_nodes_s: float = bounded(
        60.0, ge=0, fix="set notify.below_min_nodes_s=60 (seconds; 0: at once)"
    )
    # Each command run and each POST gets this long; training never waits for either.
    timeout_s: float = bounded(5.0, gt=0, fix=SECONDS)
