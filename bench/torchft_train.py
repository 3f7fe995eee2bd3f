"""The torchft peer's job: the shared torchrun peer's ``train.py`` as torchft runs it.

The same step as ``shared/bench/peer_torchrun/train.py`` (a 512-1024-10 MLP on random data,
batch 32, SGD with momentum, the step padded with ``STEP_SLEEP``), so that a bench compares
recovery logic and not jobs. This process is one replica group of one rank: it hosts its
group's TCPStore, and its torchft ``Manager`` (``ProcessGroupGloo``, ``OptimizerWrapper``)
asks the lighthouse at ``TORCHFT_LIGHTHOUSE`` for a quorum every step. A step whose
all-reduce failed is not committed and is trained again under the next quorum, so nothing
rolls back to a checkpoint, and a replica that joins late heals from a live peer: no
checkpoint file.

The gradients are averaged in one ``Manager.allreduce`` (as DDP's one bucket would), whose
failure is reported to the manager and not raised. torchft's DDP wrapper is used only with
``DDP_WRAPPER=1``: in torchft 0.2.0 its comm hook asserts (``assert fut._fut``,
torchft/ddp.py) once an all-reduce failed, and the survivors exit. Whether a fault lands in an
all-reduce is a matter of timing.

It appends to ``$LOG_DIR/$NODE_NAME.log`` the lines the torchrun peer writes: ``start
wall_time world= rank= from_step= init_s=`` before its first committed step, and ``step N
wall_time world`` for each committed step only (``N`` is torchft's committed step count, and
``world`` the replica groups that took part), so the same stall and redone-step definitions
apply. Runs under the bench's ``.venv-torchft`` (bench/torchft_peer.py).

Environment: ``LOG_DIR``, ``NODE_NAME``, ``REPLICA_ID`` (0, 1, 2: the quorum orders replicas
by it, so replica 0 hosts the quorum's store), ``TORCHFT_LIGHTHOUSE``, ``STEPS``,
``STEP_SLEEP``, ``MIN_REPLICAS``, ``TIMEOUT_S`` (the Manager's and gloo's timeout; unset:
torchft's defaults, 60 s each) and ``DDP_WRAPPER``.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.optim import OptimizerWrapper

BATCH = 32


def build(replica: str) -> tuple[torch.nn.Module, torch.optim.SGD, Manager, TCPStore]:
    """The model, its SGD and this replica group's torchft Manager, over a store it hosts."""
    timeout = os.environ.get("TIMEOUT_S")
    timeouts = {"timeout": timedelta(seconds=float(timeout))} if timeout else {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    )
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["opt"])

    # The replica group's own store (one rank: this process hosts it); the quorum's process
    # group meets in the store of the quorum's first replica.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(**timeouts),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=int(os.environ.get("MIN_REPLICAS", "2")),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        replica_id=replica,
        hostname="127.0.0.1",
        **timeouts,
    )
    return model, inner, manager, store


def average(manager: Manager, grads: list[torch.Tensor]) -> None:
    """Average the gradients over the quorum in one all-reduce, as DDP's one bucket does.

    A failed all-reduce is reported to the manager, which then does not commit the step."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def main() -> None:
    t0 = time.time()
    steps = int(os.environ.get("STEPS", "400"))
    step_sleep = float(os.environ.get("STEP_SLEEP", "0.02"))
    replica = os.environ["REPLICA_ID"]
    model, inner, manager, _store = build(replica)
    wrapper = os.environ.get("DDP_WRAPPER") == "1"
    forward = DistributedDataParallel(manager, model) if wrapper else model
    opt = OptimizerWrapper(manager, inner)
    started = False
    with open(f"{os.environ['LOG_DIR']}/{os.environ['NODE_NAME']}.log", "a") as log:
        while manager.current_step() < steps:
            x, y = torch.randn(BATCH, 512), torch.randint(0, 10, (BATCH,))
            opt.zero_grad()  # starts this step's quorum
            torch.nn.functional.cross_entropy(forward(x), y).backward()
            if not wrapper:
                average(manager, [p.grad for p in model.parameters()])
            world = manager.num_participants()
            for group in inner.param_groups:
                group["lr"] = 0.01 * world
            before = manager.current_step()
            opt.step()  # steps the SGD only if the all-reduce and the quorum went well
            time.sleep(step_sleep)
            if manager.current_step() == before:
                continue  # not committed: trained again under the next quorum
            if not started:
                log.write(
                    f"start {time.time():.4f} world={world} rank={replica} "
                    f"from_step={before} init_s={time.time() - t0:.3f}\n"
                )
                started = True
            log.write(f"step {manager.current_step()} {time.time():.4f} {world}\n")
            log.flush()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
