"""The round's group for checkpoint saves: a gloo group beside the training group.

Checkpoint saves run on a thread of their own (:mod:`elastic.async_checkpoint`): on the training
group, their collectives would interleave with training's in a different order on each rank. The
group is made with the round's training group and let go with it
(:class:`elastic.communicator.Communicator`).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from elastic import gloo_device
from elastic.sched_policy import helpers_yield


class SaveGroup:
    """Holds the current round's save group, between its set-up and the round's close."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.group: dist.ProcessGroup | None = None  # this round's, for checkpoint saves

    def open(self) -> None:
        """Make this round's save group, once its training group is set up.

        It is a collective of the round's ranks."""
        gloo_device.register()  # on the process's gloo devices: no polling thread of its own
        with helpers_yield():
            self.group = dist.new_group(
                backend=gloo_device.BACKEND, timeout=self.timeout, group_desc="checkpoint saves"
            )

    def drop(self) -> None:
        """Let go of the group, destroyed with the training group.

        A group lives (threads, sockets) while a reference does; a save still running holds its
        own."""
        self.group = None
