"""What runs on a node beside the workers, and the commands an operator types.

The modules here are the launch, ``python -m launcher`` (:mod:`launcher.cli`, composed by
:mod:`launcher.compose`, run on this machine by :mod:`launcher.local_cluster`, watched through
:mod:`launcher.progress`); :mod:`launcher.commands` holds the commands an operator runs beside a
job (``launcher.commands.status``, ``.doctor``, ``.quarantine``, ``.disk_usage``). The other
subpackages are the roles: :mod:`launcher.agent` (the per-node agent and its workers),
:mod:`launcher.rendezvous` (etcd, keys, membership, rounds), :mod:`launcher.health` (checks and
quarantine), :mod:`launcher.metrics` (each agent's Prometheus endpoint) and
:mod:`launcher.torchrun` (torchrun's ``etcd-v3`` backend).
"""
