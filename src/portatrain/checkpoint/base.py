"""The frozen base of a run: what trains is what a step checkpoint saves.

LoRA freezes every weight but its adapters (``requires_grad=False``). A step checkpoint that held
the whole model would write the same frozen weights at every save (2.3 GB a save for a Qwen3-0.6B
shape in fp32) beside a few MB of adapters and their optimizer state. So when a model has frozen
parameters, a step checkpoint's DCP data holds the trainable parameters (and the buffers
checkpoints keep) and the optimizer state only, and its ``trainer_state.json`` records where the
frozen ones are, with a content hash:

- ``{"kind": "init_from", "path": <model.init_from>, "sha256": ...}`` when the run started from
  Hugging Face weights (``model.init_from``): the frozen parameters are those files' tensors, and
  nothing is copied;
- ``{"kind": "checkpoint", "path": "<run_dir>/checkpoints/base", "sha256": ...}`` otherwise: the
  frozen parameters written once per run, by its first save, as a DCP checkpoint of their own
  (:func:`write_base`; resharded on load like any checkpoint, each tensor's checksum in
  ``base.json``), outside rotation.

The SHA-256 covers the bytes of the base's weight files (:func:`weight_files`: every
``*.safetensors`` of a Hugging Face directory, every file of a base checkpoint), streamed. It is
taken once per run, when the base is first referenced, and every load (resume, ``eval``,
``export``) checks it once before a byte of the base is trusted (:func:`checked_reference`): a base
that is missing or changed since the checkpoint was written is one line naming its path.
:class:`ModelTensors` reads a checkpoint's model tensors by name wherever they live (``export``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from portatrain.checkpoint.common import (
    FORMAT,
    METADATA,
    TRAINER_STATE,
    CheckpointError,
    any_rank,
    broadcast_from_main,
    fsync_dir,
    get_rank,
    get_world_size,
    root_causes,
    short_cause,
    write_json,
)
from portatrain.checkpoint.diagnostics import raise_save_failure
from portatrain.checkpoint.discovery import read_index
from portatrain.checkpoint.hf import read_hf_tensors
from portatrain.checkpoint.safe_metadata import safe_reader
from portatrain.checkpoint.verify import ALGORITHM, check_json_digest, checksums, flat_tensors

if TYPE_CHECKING:
    from portatrain.models.spec import ModelSpec

logger = logging.getLogger(__name__)

BASE_DIR = "base"
"""The base checkpoint of a run, beside its ``step_<N>`` directories (never rotated)."""
BASE_STATE = "base.json"
"""The base checkpoint's JSON: format, world size and the checksum of every tensor."""
KINDS = ("init_from", "checkpoint")
_CHUNK = 8 << 20  # bytes hashed per read: large reads keep the hash at the disk's (or cache's) speed


def has_frozen_parameters(model: nn.Module) -> bool:
    """Whether any rank's part of ``model`` has a parameter with ``requires_grad=False`` (collective:
    pipeline stages hold different layers)."""
    return any_rank(any(not p.requires_grad for p in model.parameters()))


def trainable_options() -> Any:
    """DCP's state-dict options that leave the frozen parameters out (buffers stay in)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True)


def frozen_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen parameters of ``model`` under their state-dict names (this rank's shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    trainable = get_model_state_dict(model, options=trainable_options())
    return {k: v for k, v in get_model_state_dict(model).items() if k not in trainable}


def weight_files(kind: str, path: Path) -> list[Path]:
    """The files a base's SHA-256 covers, in hashing order."""
    pattern = "*.safetensors" if kind == "init_from" else "*"
    return sorted(p for p in path.glob(pattern) if p.is_file()) if path.is_dir() else []


def content_sha256(files: list[Path]) -> str:
    """SHA-256 over each file's name and bytes, in the order given (streamed: constant memory)."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as stream:
            while size := stream.readinto(buffer):
                digest.update(view[:size])
    return digest.hexdigest()


def init_from_reference(hf_dir: str | Path) -> dict[str, str]:
    """The reference to the Hugging Face directory a run's frozen weights were loaded from (rank 0
    hashes it; collective)."""
    path = Path(hf_dir).resolve()
    reference, error = None, None
    if get_rank() == 0:
        try:
            reference = {"kind": "init_from", "path": str(path), "sha256": _sha256_of("init_from", path)}
        except OSError as exc:
            error = f"model.init_from={hf_dir}: cannot hash its weights for the checkpoint's base reference ({exc})"
    reference, error = broadcast_from_main((reference, error))
    if error is not None:
        raise CheckpointError(error)
    return reference


def _sha256_of(kind: str, path: Path) -> str:
    files = weight_files(kind, path)
    if not files:
        raise FileNotFoundError(f"no weight file in {path}")
    return content_sha256(files)


def write_base(folder: Path, step: int, model: nn.Module, *, is_main: bool) -> dict[str, str]:
    """Write ``model``'s frozen parameters to ``folder/base`` (collective; atomic: ``base.tmp`` renamed
    in once every rank has written, an existing base replaced) and return the reference to it. A
    failure removes the partial files and raises one :class:`CheckpointError` on every rank (the save
    of step ``step`` does not happen)."""
    import torch.distributed.checkpoint as dcp

    final, tmp = folder / BASE_DIR, folder / f"{BASE_DIR}.tmp"
    tensors = {"model": frozen_state_dict(model)}
    error: BaseException | None = None
    if is_main:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a process killed while writing it
            tmp.mkdir()
        except OSError as exc:
            error = exc
    if any_rank(error is not None):
        raise_save_failure(folder, step, final, tmp, error, tensors, is_main=is_main)
    sums = checksums(flat_tensors(tensors))  # collective: what a load of the base compares with
    try:
        dcp.save(tensors, checkpoint_id=str(tmp))
    except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
        error = exc
    reference = None
    if is_main and error is None:
        try:
            state = {
                "format": FORMAT,
                "world_size": get_world_size(),
                "checksums": {"algorithm": ALGORITHM, "tensors": sums},
            }
            write_json(tmp / BASE_STATE, state)
            sha256 = content_sha256(weight_files("checkpoint", tmp))  # the names stay after the rename
            _rename_in(final, tmp)
            reference = {"kind": "checkpoint", "path": str(final.resolve()), "sha256": sha256}
        except OSError as exc:
            error = exc
    if any_rank(error is not None):
        raise_save_failure(folder, step, final, tmp, error, tensors, is_main=is_main)
    if is_main:
        logger.info("saved the frozen base model %s (once per run; step checkpoints reference it)", final)
    return broadcast_from_main(reference)


def _rename_in(final: Path, tmp: Path) -> None:
    """``tmp`` -> ``final``; an existing ``final`` (left by an earlier run in this directory that was
    not resumed) is renamed aside first and deleted after: a base is complete or absent."""
    aside = final.with_name(final.name + ".old")
    shutil.rmtree(aside, ignore_errors=True)
    if final.exists():
        logger.warning("replacing the frozen base %s, which this run did not load", final)
        final.rename(aside)
    tmp.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def checked_reference(checkpoint: Path, state: Mapping[str, Any]) -> dict[str, str] | None:
    """The base checkpoint ``checkpoint`` references (``state`` is its trainer state), once its files
    are found and their SHA-256 is the one recorded; None for a checkpoint that holds every tensor
    itself (no frozen parameters, or written before bases existed). Collective: rank 0 hashes, and
    every rank raises its verdict, a one-line :class:`CheckpointError`."""
    if "base" not in state:
        return None
    reference, error = None, None
    if get_rank() == 0:
        try:
            reference = _check(Path(checkpoint), state["base"])
        except CheckpointError as exc:
            error = str(exc)
    reference, error = broadcast_from_main((reference, error))
    if error is not None:
        raise CheckpointError(error)
    return reference


def _check(checkpoint: Path, reference: Any) -> dict[str, str]:
    fields = ("kind", "path", "sha256")
    if not (
        isinstance(reference, dict)
        and all(isinstance(reference.get(k), str) for k in fields)
        and reference["kind"] in KINDS
    ):
        raise CheckpointError(
            f"checkpoint file {checkpoint / TRAINER_STATE}: its base reference {reference!r} is damaged "
            f"(a dict of {', '.join(fields)} with kind one of {', '.join(KINDS)}); resume from an "
            "earlier step_* directory"
        )
    kind, recorded = reference["kind"], Path(reference["path"])
    origin = "model.init_from of the run that wrote it" if kind == "init_from" else "its run's frozen weights"
    # A base checkpoint is looked for beside the step first (a run directory that was moved or copied
    # holds its own), then where it was written; the hash decides which one is the base.
    candidates = [checkpoint.parent / BASE_DIR, recorded] if kind == "checkpoint" else [recorded]
    found = [p for p in dict.fromkeys(c.resolve() for c in candidates) if weight_files(kind, p)]
    if not found:
        raise CheckpointError(
            f"the base model of checkpoint {checkpoint} is missing: {recorded} ({origin}) "
            f"{'has no weight file' if recorded.is_dir() else 'does not exist'}; the checkpoint holds "
            "only the trainable parameters, so put the base back at that path"
        )
    hashes = {}
    for path in found:
        try:
            hashes[path] = content_sha256(weight_files(kind, path))
        except OSError as exc:
            raise CheckpointError(
                f"the base model of checkpoint {checkpoint}, {path}, is unreadable: {exc}"
            ) from None
        if hashes[path] == reference["sha256"]:
            return {**reference, "path": str(path)}
    raise CheckpointError(
        f"the base model changed since the checkpoint was written; {found[0]} ({origin}) has SHA-256 "
        f"{hashes[found[0]][:16]}..., checkpoint {checkpoint} recorded {reference['sha256'][:16]}...: put back "
        "the base it was trained on, or start a new run from the new one (a new run_dir)"
    )


def read_base_state(path: Path) -> dict[str, Any]:
    """A base checkpoint's ``base.json`` (its digest checked)."""
    file = path / BASE_STATE
    fix = "put back the base this run wrote, or start a new run"
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"the base checkpoint file {file} is unreadable ({exc}); {fix}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"the base checkpoint file {file} is not a portatrain base ({FORMAT}); {fix}")
    return check_json_digest(file, state, fix)


class ModelTensors:
    """A checkpoint's model tensors, read by their names wherever they live: its own files, or, for
    the frozen parameters of a checkpoint with a base, the base it references (checked first). One
    process, whole tensors on the CPU (``portatrain export``).

    ``like`` holds every model tensor (on meta: shapes, and the family's order), ``spec`` the family
    (its Hugging Face names, for a base read from ``model.init_from``).
    """

    def __init__(
        self,
        checkpoint: Path,
        state: Mapping[str, Any],
        metadata: Any,
        *,
        like: Mapping[str, torch.Tensor],
        spec: ModelSpec,
    ) -> None:
        self.checkpoint, self.metadata, self.like, self.spec = Path(checkpoint), metadata, like, spec
        self.base = checked_reference(self.checkpoint, state)
        self.base_metadata = (
            read_index(Path(self.base["path"])) if self.base and self.base["kind"] == "checkpoint" else None
        )
        # A Hugging Face base is read in the dtype the run held it in: its weights' (the adapters').
        entries = metadata.state_dict_metadata.items()
        saved = [v.properties.dtype for k, v in entries if k.startswith("model.") and k.endswith(".weight")]
        self.dtype = saved[0] if saved else torch.float32

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``keys`` (a partial read: only these are read from disk)."""
        own = [k for k in keys if f"model.{k}" in self.metadata.state_dict_metadata]
        rest = [k for k in keys if f"model.{k}" not in self.metadata.state_dict_metadata]
        tensors = _read_dcp(self.checkpoint, self.metadata, own) if own else {}
        if rest and self.base is None:
            raise CheckpointError(f"checkpoint {self.checkpoint / METADATA} has no tensor model.{rest[0]}")
        if rest and self.base_metadata is not None:
            tensors.update(_read_dcp(Path(self.base["path"]), self.base_metadata, rest))
        elif rest:
            template = {k: torch.empty(self.like[k].shape, dtype=self.dtype) for k in rest}
            tensors.update(read_hf_tensors(self.base["path"], template, self.spec))
        return {k: tensors[k] for k in keys}


def _read_dcp(path: Path, metadata: Any, keys: list[str]) -> dict[str, torch.Tensor]:
    """The ``model.<key>`` tensors of the DCP directory ``path`` for ``keys`` (only these are read)."""
    import torch.distributed.checkpoint as dcp

    entries = {key: metadata.state_dict_metadata.get(f"model.{key}") for key in keys}
    missing = [key for key, entry in entries.items() if entry is None]
    if missing:
        raise CheckpointError(f"checkpoint {path / METADATA} has no tensor model.{missing[0]}")
    tensors = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in entries.items()}
    try:
        dcp.load({"model": tensors}, storage_reader=safe_reader(str(path)))
    except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
        raise CheckpointError(
            f"reading checkpoint {path} failed ({short_cause(root_causes(exc)[0])}); a *.distcp "
            "file was overwritten or damaged -- export an earlier step_* directory"
        ) from None
    return tensors


__all__ = [
    "BASE_DIR",
    "BASE_STATE",
    "ModelTensors",
    "checked_reference",
    "content_sha256",
    "frozen_state_dict",
    "has_frozen_parameters",
    "init_from_reference",
    "read_base_state",
    "trainable_options",
    "weight_files",
    "write_base",
]
