"""Checkpoints that survive everything: sharded, atomic, resumable, reshardable.

One module per concern:

- ``checkpointer.py`` -- :class:`Checkpointer` saves a training state with
  ``torch.distributed.checkpoint`` (DCP) every ``checkpoint.every`` steps and at the end, keeps the
  last K, and loads one back -- into the same or a different number of ranks (FSDP2 DTensors are
  resharded by DCP's planner);
- ``discovery.py`` -- :func:`complete_checkpoints`, :func:`read_trainer_state` and
  :func:`inspect_checkpoint` find and check checkpoints without reading their tensors;
- ``restore.py`` -- reading a checkpoint back into a model: shapes checked against the index, a
  referenced frozen base loaded first, tensors verified; :func:`load_model_weights` (weights only);
- ``rotation.py`` -- renames a written save in (replacing a stale one, superseding later steps) and
  deletes those beyond ``checkpoint.keep``, each step a rename;
- ``diagnostics.py`` -- the one-line report of a failed save (a full disk: how much a checkpoint
  needs and how much is free) or of a checkpoint whose tensors are unreadable;
- ``staging.py`` -- ``checkpoint.async_mode=thread|process``: the staging copy (reused host buffers,
  pinned on CUDA) that DCP's ``async_save`` writes in the background while training goes on, and
  the thread that commits it;
- ``resume.py`` -- the resume policy: :func:`resolve_resume` turns ``checkpoint.resume``
  (``none``/``auto``/a path) into a directory and refuses to start a new run over another run's
  checkpoints; :func:`load_dataloader_state` continues the data order;
- ``preemption.py`` -- :class:`PreemptionWatcher` turns SIGTERM and Ctrl-C into "save at the next
  step boundary, then stop" (a second Ctrl-C exits at once), and :func:`sigterm_interrupts` makes
  SIGTERM stop a run that has not started training yet as Ctrl-C does;
- ``verify.py`` -- is a checkpoint whole: content checksums of every model and optimizer tensor,
  written with every save and compared at every load, and the finiteness check that resume and
  ``export`` share (:func:`nonfinite_keys`); a failure is a :class:`DamagedCheckpointError`, which
  ``checkpoint.resume=auto`` answers by loading the checkpoint before;
- ``safe_metadata.py`` -- :func:`safe_reader`, the DCP reader every load goes through: it unpickles
  DCP's ``.metadata`` index with an unpickler that admits only DCP's own metadata classes, and
  refuses an index that declares any non-tensor (pickled) entry before reading a byte of it
  (:class:`UnsafeCheckpointError`; ``checkpoint.resume=auto`` skips such a checkpoint and says so);
- ``base.py`` -- a model with frozen parameters (LoRA): its step checkpoints hold the trainable
  parameters and the optimizer state, and reference the frozen base by path and SHA-256 -- the
  ``model.init_from`` directory, or ``<run_dir>/checkpoints/base`` written once per run -- which
  every load checks before it reads it; :class:`ModelTensors` reads a checkpoint's model tensors
  wherever they live (``export``);
- ``hf.py`` -- :func:`load_hf_weights` initializes a model from a local Hugging Face safetensors
  directory through its family's ``ModelSpec``, each rank reading only the slices it holds;
- ``common.py`` -- :class:`CheckpointError` (a ``UserError``: the one error a user sees for a
  missing, truncated or mismatched checkpoint; the CLI prints it without a traceback), file names
  and rank helpers.

Layout of ``<run_dir>/checkpoints/step_<N>/``::

    .metadata                DCP's index of every tensor chunk (written last, by rank 0)
    __<rank>_0.distcp        tensors: model, optimizer state, each rank's RNG state
    trainer_state.json       step, tokens seen, LR scheduler, optimizer hyper-parameters,
                             model family and architecture, recipe, world size, and a content
                             checksum of every model and optimizer tensor (rank 0)
    dataloader_rank<R>.json  each rank's StatefulDataLoader state
    config.yaml              the resolved config of the run that saved it

A model with frozen parameters saves them once, in ``<run_dir>/checkpoints/base/`` (``.metadata``,
``__<rank>_0.distcp``, ``base.json``: world size and tensor checksums), unless they came from
``model.init_from``; each ``trainer_state.json`` then records ``base``: kind, path and SHA-256.

Only tensors go through DCP, everything else is JSON: DCP stores non-tensor values with
``torch.save`` and reads them back with ``torch.load(weights_only=False)``, which would execute
whatever a checkpoint file contains. DCP's own ``.metadata`` index is a pickle: it is read with a
restricted unpickler (``safe_metadata.py``) that refuses any other class before calling it.

Atomicity: a save writes ``step_<N>.tmp`` and rank 0 renames it to ``step_<N>`` after every rank
has finished (DCP writes ``.metadata`` only then). A process killed mid-save leaves a ``.tmp``
directory that :func:`complete_checkpoints` ignores and the next save deletes, so the previous
checkpoint stays the newest complete one. A save always writes the state it is given or raises: an
existing ``step_<N>`` (broken, or left by a run rolled back past it) is replaced -- the old one is
renamed ``step_<N>.old``, the new one renamed in, the old one deleted -- and rotation renames a
checkpoint ``step_<N>.deleting`` before deleting it, so no half-deleted ``step_<N>`` is ever seen.
A failed save (disk full...) removes its partial files and raises a ``CheckpointError`` on every rank.
An asynchronous save keeps all of this: it writes the same ``.tmp`` directory in the background and
is renamed in (and only then logged "saved") once every rank's write is done; one save is in flight
at most, and a failure is raised where the loop next waits for it (the next save, or the end).
"""

from __future__ import annotations

from portatrain.checkpoint.base import BASE_DIR, ModelTensors
from portatrain.checkpoint.checkpointer import Checkpointer, model_args_dict
from portatrain.checkpoint.common import FORMAT, CheckpointError, UnsafeCheckpointError
from portatrain.checkpoint.discovery import complete_checkpoints, inspect_checkpoint, read_trainer_state
from portatrain.checkpoint.hf import load_hf_weights
from portatrain.checkpoint.preemption import PreemptionWatcher, sigterm_interrupts
from portatrain.checkpoint.restore import LEGACY_MODEL_NAME, load_model_weights
from portatrain.checkpoint.resume import find_checkpoint, load_dataloader_state, newest_usable, resolve_resume
from portatrain.checkpoint.safe_metadata import UnsafeMetadataError, safe_reader
from portatrain.checkpoint.verify import DamagedCheckpointError, nonfinite_keys

__all__ = [
    "BASE_DIR",
    "FORMAT",
    "LEGACY_MODEL_NAME",
    "CheckpointError",
    "Checkpointer",
    "DamagedCheckpointError",
    "ModelTensors",
    "PreemptionWatcher",
    "complete_checkpoints",
    "find_checkpoint",
    "inspect_checkpoint",
    "load_dataloader_state",
    "load_hf_weights",
    "load_model_weights",
    "model_args_dict",
    "newest_usable",
    "nonfinite_keys",
    "read_trainer_state",
    "resolve_resume",
    "safe_reader",
    "sigterm_interrupts",
    "UnsafeCheckpointError",
    "UnsafeMetadataError",
]
