"""torchrun's entry point for ``--rdzv-backend=etcd-v3`` (the ``torchrun.handlers`` group).

torch loads every handler of that group whenever ``torch.distributed.elastic.rendezvous`` is
imported, which ``torch.distributed.checkpoint`` does too, so in workers as well. This module is
all that they load: the backend (``launcher/torchrun/backend.py``) and the etcd client are
imported only when torchrun creates the handler, and no worker loads the agent's code.
"""

from __future__ import annotations

from typing import Any


def handler() -> Any:
    """Called by torch at registration: returns the handler factory."""
    return create_rdzv_handler


def create_rdzv_handler(params: Any) -> Any:
    from launcher.torchrun.backend import create_rdzv_handler as create

    return create(params)
