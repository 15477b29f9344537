"""Process-group setup from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK).

Under ``torchrun`` the workers meet in the agent's TCPStore (``MASTER_ADDR:MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE=True``). That store outlives the workers: after a restart
(``--max-restarts``) it still holds the keys the previous attempt's process groups wrote, under the
same names, among them each rank's gloo address. A restarted rank that reads a peer's key before the
peer rewrote it connects to the dead process's port: ``Gloo connectFullMesh failed ... Connection
refused``, and the restart fails. So each attempt gets a store of its own (:func:`_attempt_store`):
rank 0 serves a fresh, empty TCPStore and announces it in the agent's store with a nonce; the other
ranks use the announcement once the store it names answers with that nonce (a stale one names a
dead or foreign store and is read again).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from portatrain.accelerators import Accelerator


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info_from_env() -> DistInfo:
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_distributed(accelerator: Accelerator, info: DistInfo) -> None:
    """Create the default process group with the adapter's backend when launched with >1 process."""
    if info.world_size > 1 and not dist.is_initialized():
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = _attempt_store(info, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            dist.init_process_group(
                backend=accelerator.dist_backend, store=store, rank=info.rank, world_size=info.world_size
            )
        else:
            dist.init_process_group(backend=accelerator.dist_backend)


ATTEMPT_STORE_KEY = "portatrain/attempt_store"
"""The agent-store key under which rank 0 announces this attempt's store: ``port nonce``."""


def _attempt_store(
    info: DistInfo, host: str, agent_port: int, timeout: timedelta = dist.default_pg_timeout
) -> dist.Store:
    """A TCPStore for this attempt's workers only, served by rank 0 on a free port of ``host``."""
    agent = dist.TCPStore(host, agent_port, is_master=False, timeout=timeout)
    if info.rank == 0:
        nonce = uuid.uuid4().hex
        store = dist.TCPStore(
            host, 0, info.world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        store.set(ATTEMPT_STORE_KEY, nonce)
        agent.set(ATTEMPT_STORE_KEY, f"{store.port} {nonce}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        agent.wait([ATTEMPT_STORE_KEY])
        port, nonce = agent.get(ATTEMPT_STORE_KEY).decode().split()
        try:
            # A plain connect first: the previous attempt's server is gone (refused), and TCPStore
            # would retry it for its whole timeout and log a C++ stack on giving up.
            socket.create_connection((host, int(port)), timeout=5).close()
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
            if store.check([ATTEMPT_STORE_KEY]) and store.get(ATTEMPT_STORE_KEY).decode() == nonce:
                store.set_timeout(timeout)
                return store
        except (OSError, RuntimeError):  # refused, or a store that is not this attempt's
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {info.rank}: rank 0 announced no store for this attempt in {timeout} "
                f"(the agent's store at {host}:{agent_port} still names {port})"
            )
        time.sleep(0.2)


def destroy_distributed() -> None:
    """Tear the process group down in step: a rank that leaves while a peer's gloo threads still
    talk to it can abort the peer ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
