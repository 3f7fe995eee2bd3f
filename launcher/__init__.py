"""What runs on a node beside the workers, and the commands an operator types.

The modules here are the commands: ``python -m launcher`` (:mod:`launcher.cli`, composed by
:mod:`launcher.compose`, run on this machine by :mod:`launcher.local_cluster`, watched through
:mod:`launcher.progress`), ``launcher.status``, ``launcher.doctor`` and ``launcher.quarantine``.
The subpackages are the roles: :mod:`launcher.agent` (the per-node agent and its workers),
:mod:`launcher.rendezvous` (etcd, keys, membership, rounds), :mod:`launcher.health` (checks and
quarantine) and :mod:`launcher.torchrun` (torchrun's ``etcd-v3`` backend).
"""
