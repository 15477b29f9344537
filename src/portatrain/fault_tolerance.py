"""Fault tolerance without restarts, on torchft (https://github.com/pytorch/torchft).

With ``fault_tolerance.enabled=true`` the replicate axis of the data-parallel mesh is not a mesh
dimension but ``fault_tolerance.group_size`` *replica groups*, each its own job (its own torchrun, its
own rendezvous and store, FSDP2 over ``parallel.dp_shard`` inside it), coordinated by torchft's
lighthouse (``portatrain lighthouse``). This is torchtitan's FT-HSDP
(``torchtitan/components/ft/manager.py`` in https://github.com/pytorch/torchtitan):

* every step starts with a **quorum** (:meth:`ReplicaGroups.start_step`): the lighthouse tells each live
  group who takes part. A group that is behind (a replacement for one that died, at step 0) is
  **healed** there, by live recovery: it receives a healthy group's state over HTTP (model, optimizer,
  LR schedule, step, tokens seen, data position, RNG: the trainer's ``state_dict``/``load_state_dict``
  callables) and joins the quorum at that group's step;
* the gradients (each rank's FSDP2 shard, already reduced over ``dp_shard``) are **averaged across
  the groups in the quorum** by torchft's Manager (:meth:`ReplicaGroups.average_gradients`), on a
  process group reconfigured at each new quorum (gloo on CPU, NCCL on CUDA);
* the optimizer steps only when the step **commits** (:meth:`ReplicaGroups.should_commit`, the
  ``should_commit`` vote of torchft's ``OptimizerWrapper``): a group that failed during the step
  retries it with the next batch, and so does every group when fewer than
  ``fault_tolerance.min_replicas`` took part.

A group that dies takes its slice of the data with it until it is back: the others train on at a
smaller global batch (what torchtitan and torchft do), without a restart.

The quorum runs synchronously at the start of the step (``use_async_quorum=False``): a healed group
applies the received state before its first forward, so the trainer reloads its data position
before drawing the step's batches.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from portatrain.config import FaultToleranceConfig, ParallelConfig
from portatrain.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's environment variable for the lighthouse address (read when ``fault_tolerance.lighthouse`` is None)."""

LIGHTHOUSE_PORT = 29510
"""The port ``portatrain lighthouse`` serves on by default, and rendered jobs' lighthouse."""

PROCESS_GROUPS = {"cpu": "ProcessGroupGloo", "cuda": "ProcessGroupNCCL"}
"""Device type -> torchft's reconfigurable process group for the cross-group all-reduce."""


class LighthouseError(UserError):
    """No lighthouse answered at the configured address within ``fault_tolerance.timeout_s``."""


class QuorumError(UserError):
    """No quorum, or no step committed, within ``fault_tolerance.quorum_timeout_s``: the replica groups
    a step needs are not running (a survivor stops with this line instead of waiting for ever)."""


def lighthouse_problem(address: str, key: str) -> str | None:
    """Why ``address`` is not a lighthouse URL (``http://HOST:PORT``), or None. torchft's client needs
    the scheme: without it, it retries for ``connect_timeout`` and then says "scheme is missing"."""
    parts = urlsplit(address)
    if parts.scheme in ("http", "https") and parts.hostname:
        try:
            parts.port  # noqa: B018 (parsing it is the check)
        except ValueError:
            return f"{key}={address!r} has no valid port; give it as http://HOST:PORT (0..65535)"
        return None
    suggestion = "http://" + address.split("://")[-1]
    return f"{key}={address!r} is not an http://HOST:PORT address; did you mean {suggestion}?"


def fault_tolerance_problems(
    ft: FaultToleranceConfig, parallel: ParallelConfig, device_type: str
) -> list[str]:
    """The problems of ``fault_tolerance`` (none when disabled), each with its fix."""
    if not ft.enabled:
        return []
    problems = []
    if ft.group_size < 1:
        problems.append(
            f"fault_tolerance.group_size={ft.group_size} must be >= 1 (the number of replica groups)"
        )
    elif not 0 <= ft.replica_id < ft.group_size:
        problems.append(
            f"fault_tolerance.replica_id={ft.replica_id} must be in 0..{ft.group_size - 1} "
            f"(fault_tolerance.group_size={ft.group_size}); give each group its own id"
        )
    if not 1 <= ft.min_replicas <= max(ft.group_size, 1):
        problems.append(
            f"fault_tolerance.min_replicas={ft.min_replicas} must be in 1..group_size={ft.group_size} "
            "(the replica groups a step needs; 1 lets one survivor train on)"
        )
    for key in ("timeout_s", "quorum_timeout_s"):
        if not getattr(ft, key) > 0:
            problems.append(f"fault_tolerance.{key}={getattr(ft, key)} must be positive (seconds)")
    lighthouse = lighthouse_problem(ft.lighthouse, "fault_tolerance.lighthouse") if ft.lighthouse else None
    if lighthouse is not None:
        problems.append(lighthouse)
    if parallel.dp_replicate != 1:
        problems.append(
            f"parallel.dp_replicate={parallel.dp_replicate} with fault_tolerance.enabled=true: the replicate "
            "axis is the replica groups; set parallel.dp_replicate=1 and fault_tolerance.group_size="
            f"{parallel.dp_replicate}"
        )
    if parallel.pp != 1:
        problems.append(
            f"parallel.pp={parallel.pp} with fault_tolerance.enabled=true: a replica group is FSDP2 (+ tp, cp) "
            "only here; set parallel.pp=1"
        )
    if device_type not in (*PROCESS_GROUPS, "auto"):
        problems.append(
            f"fault_tolerance.enabled=true on device.type={device_type}: torchft's process groups are gloo "
            f"(cpu) and NCCL (cuda); use device={' or device='.join(PROCESS_GROUPS)}"
        )
    return problems


def data_slice(ft: FaultToleranceConfig, dp_rank: int, dp: int) -> tuple[int, int]:
    """``(rank, world)`` among the ranks that read different rows: this group's ``dp`` ranks are the
    ``replica_id``-th block of ``group_size * dp``, as dp_replicate's outer index slices the batch."""
    if not ft.enabled:
        return dp_rank, dp
    return ft.replica_id * dp + dp_rank, ft.group_size * dp


def replica_run_dir(ft: FaultToleranceConfig, run_dir: Path) -> Path:
    """Each replica group writes its metrics and checkpoints under ``<run_dir>/replica_<id>``."""
    return run_dir / f"replica_{ft.replica_id}" if ft.enabled else run_dir


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def module_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of ``model``'s state (each DTensor's local shard): what a peer rank of the same
    group rank loads with :func:`load_module_state`."""
    return {k: _local(v).detach() for k, v in model.state_dict().items()}


@torch.no_grad()
def load_module_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a peer's :func:`module_state` into ``model``, bit for bit."""
    for k, v in model.state_dict().items():
        _local(v).copy_(state[k])


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with this rank's local shard of every DTensor."""
    sd = optimizer.state_dict()
    return {
        "state": {i: {k: _local(v) for k, v in s.items()} for i, s in sd["state"].items()},
        "param_groups": sd["param_groups"],
    }


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a peer's :func:`optimizer_state`: a local shard becomes a DTensor again on this rank's
    parameter's mesh and placements (a fresh group has no optimizer state yet to copy into)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt = {}
    for i, s in state["state"].items():
        param = params[int(i)]
        rebuilt[i] = {
            k: _dtensor_like(param, v)
            if isinstance(v, torch.Tensor) and v.shape == _local(param).shape
            else v
            for k, v in s.items()
        }
    optimizer.load_state_dict({"state": rebuilt, "param_groups": state["param_groups"]})


def _dtensor_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if not hasattr(param, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of this rank's part of the weights, in state-dict order: equal across replica groups
    exactly when their weights are bitwise identical."""
    digest = hashlib.sha256()
    for k, v in module_state(model).items():
        digest.update(k.encode())
        digest.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def import_torchft() -> Any:
    """torchft, or one line saying how to install it (it is the ``ft`` extra, not a core dependency)."""
    try:
        import torchft
    except ImportError as exc:
        raise ConfigError(
            f"fault tolerance needs torchft ({exc}): pip install 'portatrain[ft]' (or torchft>=0.2)"
        ) from exc
    return torchft


def tensor_only_transport(torchft: Any, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, receiving with ``torch.load(weights_only=True)``.

    A recovering group fetches a healthy group's state over HTTP; torchft's ``HTTPTransport`` reads it
    with ``weights_only=False`` (torchft/checkpointing/http_transport.py, ``_load_from_address``), so
    whatever answers that request could run code in the recovering process. What portatrain sends
    (:meth:`Trainer._replica_state`: tensors, numbers, strings, lists and dicts) loads with the
    restricted unpickler, which refuses anything else before calling it.
    """
    from torchft.checkpointing._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class TensorOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as stream:
                return _streaming_load(stream, weights_only=True)

    return TensorOnlyHTTPTransport(timeout=timeout, num_chunks=0)


TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits")
"""torchft's Python loggers. ``torchft_quorums`` and ``torchft_commits`` log one record per step at
INFO with an empty message, their fields in ``extra``, for torchft's OpenTelemetry export
(torchft/manager.py, torchft/otel.py): on a console, one blank line per step."""


def _quiet_torchft_logs(device_type: str) -> None:
    """torchft at warning level unless a level was chosen (``RUST_LOG`` for its Rust part too):
    portatrain logs each change of the quorum itself (``start_step``). Off CUDA, also the warning
    that NCCL's flight recorder could not be reset, which torchft logs at every reconfiguration
    wherever torch has no ``_reset_fr_recording_nccl``: the recorder traces NCCL collectives, and a
    gloo group has none to trace."""
    os.environ.setdefault("RUST_LOG", "warn")
    manager = logging.getLogger("torchft.manager")
    if manager.level == logging.NOTSET:
        manager.addFilter(_without_traceback)
    for name in TORCHFT_LOGGERS:
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    if device_type != "cuda":
        manager.addFilter(_not_the_flight_recorder_warning)


def _not_the_flight_recorder_warning(record: logging.LogRecord) -> bool:
    return "Unable to reset NCCL flight recorder" not in record.getMessage()


def _without_traceback(record: logging.LogRecord) -> bool:
    """torchft's Manager logs each error it handles -- a peer group that died during the all-reduce,
    the process group's reconfiguration or a recovery -- with ``logger.exception`` (torchft/manager.py,
    ``_ManagerLogger.exception``): the message names the error, the traceback is torchft's own frames,
    and the step is then retried (or the group drops the peer). One line is what a user needs; the
    traceback stays with a level chosen for ``torchft.manager``."""
    record.exc_info, record.exc_text = None, None
    return True


class ReplicaGroups:
    """This process's part in the replica groups: torchft's Manager, its process group and the store.

    ``state_dict`` and ``load_state_dict`` are the trainer's: what a healthy group sends a recovering
    one, and how the recovering one applies it. ``rank``/``world_size`` are this process's place in
    its own group (torchrun's ``RANK``/``WORLD_SIZE``); ``broadcast`` hands rank 0's value to the
    group's other ranks (the default process group), used once to share the group's store; ``step``
    is the step the trainer restored (0, or a checkpoint's).
    """

    def __init__(
        self,
        cfg: FaultToleranceConfig,
        *,
        device_type: str,
        rank: int,
        world_size: int,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        broadcast: Callable[[Any], Any],
        step: int = 0,
    ) -> None:
        _quiet_torchft_logs(device_type)
        torchft = import_torchft()
        from torch.distributed import TCPStore

        if device_type not in PROCESS_GROUPS:
            raise ConfigError(
                f"fault_tolerance.enabled=true on a {device_type} device: torchft's process groups are gloo "
                "(cpu) and NCCL (cuda); use device=cpu or device=cuda"
            )
        lighthouse = cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:  # checked here, not in validation: a rendered job learns it when it runs
            raise ConfigError(
                "fault_tolerance.enabled=true needs a lighthouse: set fault_tolerance.lighthouse=http://HOST:PORT "
                f"(or ${LIGHTHOUSE_ENV}); `portatrain lighthouse` starts one"
            )
        key = "fault_tolerance.lighthouse" if cfg.lighthouse else f"${LIGHTHOUSE_ENV}"
        problem = lighthouse_problem(lighthouse, key)
        if problem is not None:
            raise ConfigError(problem)
        self.cfg, self.rank = cfg, rank
        timeout = timedelta(seconds=cfg.timeout_s)
        # The group's own store for torchft's Manager (its manager server's address, the process group's
        # rendezvous per quorum): served by rank 0 on a free port, found by the others via the group.
        host = os.environ.get("MASTER_ADDR", "localhost")
        self._store = TCPStore(host, 0, is_master=True, wait_for_workers=False) if rank == 0 else None
        port = broadcast(self._store.port if self._store is not None else None)
        try:
            self.manager = torchft.Manager(
                pg=getattr(torchft, PROCESS_GROUPS[device_type])(timeout=timeout),
                load_state_dict=load_state_dict,
                state_dict=state_dict,
                min_replica_size=cfg.min_replicas,
                use_async_quorum=False,  # heal before the forward: the data position is reloaded first
                timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
                connect_timeout=timeout,
                rank=rank,
                world_size=world_size,
                store_addr=host,
                store_port=port,
                lighthouse_addr=lighthouse,
                replica_id=f"portatrain_{cfg.replica_id}",
                checkpoint_transport=tensor_only_transport(torchft, timeout),
                # Every group initializes the same weights from trainer.seed: nothing to sync at step 0;
                # a group that joins later than step 0 is healed all the same.
                init_sync=False,
            )
        except RuntimeError as exc:
            # torchft's client: "failed to connect to ADDRESS within timeout of Ns; ...: <the cause>".
            if "failed to connect" not in str(exc) or lighthouse not in str(exc):
                raise
            cause = str(exc).rsplit(": ", 1)[-1]
            port_hint = urlsplit(lighthouse).port or LIGHTHOUSE_PORT
            raise LighthouseError(
                f"no lighthouse answered at {key}={lighthouse} within fault_tolerance.timeout_s="
                f"{cfg.timeout_s:g} ({cause}); start one there (`portatrain lighthouse --port {port_hint}`) "
                "or point the address at the running one"
            ) from None
        # A group resumed from a checkpoint counts from its step; one behind the others is healed.
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self._participants = 0
        self._lighthouse = lighthouse
        self._progress: float | None = None  # when a step last committed (or the first quorum formed)

    def start_step(self) -> bool:
        """The quorum for the next step. True when this group was behind and has just loaded a healthy
        group's state (its step, data position and RNG changed: the caller re-reads them)."""
        before = self.manager.current_step()
        try:
            self.manager.start_quorum()
        # torchft's client after quorum_timeout ("status: Cancelled, message: "Timeout expired"").
        except TimeoutError:
            raise QuorumError(
                f"replica group {self.cfg.replica_id}: no quorum within fault_tolerance.quorum_timeout_s="
                f"{self.cfg.quorum_timeout_s:g} from the lighthouse at {self._lighthouse}, which waits for more "
                "replica groups than are running (its --min-replicas); start the missing groups, or serve the "
                "lighthouse with a --min-replicas the running groups meet"
            ) from None
        participants = self.manager.num_participants()
        healed = self.manager.current_step() != before
        if self._progress is None or healed:
            self._progress = time.monotonic()
        if participants != self._participants or healed:
            logger.info(
                "replica group %d: quorum of %d replica group(s) at step %d%s",
                self.cfg.replica_id,
                participants,
                self.manager.current_step(),
                " (healed: live recovery from a healthy group)" if healed else "",
            )
            self._participants = participants
        return healed

    def average_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """Average each gradient (this rank's local shard) over the replica groups of the quorum: one
        all-reduce per gradient dtype, of the gradients flattened into one buffer (a transient copy
        of this rank's gradient shards)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                grad = _local(p.grad)
                by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.manager.allreduce(flat).wait()
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def should_commit(self) -> bool:
        """Whether every rank of this group, in a quorum of at least ``min_replicas`` groups, finished
        the step (torchft's vote): only then may the optimizer step, the schedule and the counters move.

        A step that does not commit is retried; for no more than ``fault_tolerance.quorum_timeout_s``
        since the last one that did. A quorum smaller than ``min_replicas`` (the lighthouse serves one
        group when the others are gone) fails every vote, and torchft retries it without end (its
        ``max_retries`` is None): the group would repeat one step, silently, for ever."""
        if self.manager.should_commit():
            self._progress = time.monotonic()
            return True
        stalled = time.monotonic() - (self._progress or time.monotonic())
        if stalled > self.cfg.quorum_timeout_s:
            participants = self.manager.num_participants()
            raise QuorumError(
                f"replica group {self.cfg.replica_id}: no step committed for {stalled:.0f} s "
                f"(fault_tolerance.quorum_timeout_s={self.cfg.quorum_timeout_s:g}) in a quorum of {participants} "
                f"replica group(s), fault_tolerance.min_replicas={self.cfg.min_replicas}; start the missing "
                f"groups, or set fault_tolerance.min_replicas={max(participants, 1)} to train on without them"
            )
        return False

    def close(self, model: torch.nn.Module | None = None) -> None:
        """Log this rank's weights digest (equal across groups after recovery), leave the quorum."""
        if model is not None:
            logger.info(
                "replica group %d rank %d: step %d weights sha256 %s",
                self.cfg.replica_id,
                self.rank,
                self.manager.current_step(),
                weights_digest(model),
            )
        self.manager.shutdown(wait=False)
