"""The etcd key layout of a job: every key a process of this project reads or writes is built here.

``<rendezvous.prefix>/<job_id>`` (:attr:`JobKeys.base`) roots three trees:

- ``<base>/``: the rendezvous (the leader watches all of it, the others a few keys):
  ``nodes/<node>`` (a live node's record, under its lease), ``round`` (the current round's head),
  ``round_parts/<id>/<n>`` (the members of a round too large for one value), ``leader``,
  ``done``, ``quarantine/<node>`` (a node kept out, under the cooldown's lease) and ``progress``
  (the rank-0 node's figures, which no watch carries).
- ``<base>.health/``: ``reports/<node>``, ``strikes/<node>`` and ``stragglers/<node>`` (a node's
  newest straggler finding, under its lease), beside the rendezvous so that its watches and
  snapshots do not carry them.
- ``<base>.chaos/``: ``requests/<node>/<id>`` and ``answers/<node>/<id>``, fault requests.

A job id holds only letters, digits, ``-`` and ``_``, so ``<base>.`` up to ``<base>0`` ('.' < '/' <
'0') is one range holding the three and nothing of another job (:meth:`JobKeys.everything`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JobKeys:
    """The keys of job ``job_id`` under ``prefix`` (``rendezvous.prefix``)."""

    prefix: str
    job_id: str

    @property
    def base(self) -> str:
        return f"{self.prefix}/{self.job_id}"

    # --- the rendezvous: <base>/ -----------------------------------------------------------------

    @property
    def rendezvous(self) -> str:
        """The prefix every agent watches."""
        return self.base + "/"

    @property
    def nodes(self) -> str:
        return self.base + "/nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    @property
    def round(self) -> str:
        return self.base + "/round"

    @property
    def round_parts(self) -> str:
        return self.base + "/round_parts/"

    def round_part_folder(self, parts_id: str) -> str:
        return f"{self.round_parts}{parts_id}/"

    @property
    def leader(self) -> str:
        return self.base + "/leader"

    @property
    def done(self) -> str:
        return self.base + "/done"

    @property
    def quarantine(self) -> str:
        return self.base + "/quarantine/"

    def quarantined(self, node_id: str) -> str:
        return self.quarantine + node_id

    @property
    def progress(self) -> str:
        return self.base + "/progress"

    # --- health: <base>.health/ ------------------------------------------------------------------

    @property
    def reports(self) -> str:
        return self.base + ".health/reports/"

    def report(self, node_id: str) -> str:
        return self.reports + node_id

    @property
    def strikes(self) -> str:
        return self.base + ".health/strikes/"

    def strike(self, node_id: str) -> str:
        return self.strikes + node_id

    @property
    def stragglers(self) -> str:
        return self.base + ".health/stragglers/"

    def straggler(self, node_id: str) -> str:
        return self.stragglers + node_id

    # --- fault requests: <base>.chaos/ -----------------------------------------------------------

    def requests(self, node_id: str) -> str:
        """The folder of ``node_id``'s fault requests (one key per request id)."""
        return f"{self.base}.chaos/requests/{node_id}/"

    def answer(self, node_id: str, request_id: str) -> str:
        return f"{self.base}.chaos/answers/{node_id}/{request_id}"

    # --- all of it --------------------------------------------------------------------------------

    def everything(self) -> tuple[str, str]:
        """The one key range holding the three trees, as ``(start, end)``."""
        return self.base + ".", self.base + "0"
