"""One module per ``portatrain`` command; the CLI (``portatrain.cli``) dispatches to them by name.

A command reuses the pipeline's stages and never re-implements them. Two kinds exist:

* **Config commands** (the default) receive the composed, validated config. The module defines::

      def run(cfg: Config, ctx: CommandContext) -> None: ...
      SHORTHANDS = {"out": "export.out"}   # optional: bare keys the command reads from its section
      OVERRIDES = ["dry_run=true"]         # optional: composed before the user's overrides
      SECTIONS = ("export",)               # config sections whose options --help lists
      EXAMPLE = "portatrain export checkpoint=auto out=hf/demo"   # --help's example

  ``ctx`` carries what is not in the config: the ``Trainer`` subclass research code passed to
  ``portatrain.cli.main`` and the raw command-line overrides (which ``render`` replays in the job).
* **Argument commands** take plain ``argparse``-style arguments and skip Hydra (``audit``,
  ``kernels``...). The module sets ``HYDRA = False`` and defines::

      def main(argv: list[str]) -> int | None: ...   # the exit status; None means 0
      EXAMPLE = "portatrain audit src/"                # --help's example, before argparse's help

Either kind raises a :class:`~portatrain.errors.UserError` for anything the user must fix; the
CLI prints it as one line, with no traceback, and exits with status 2. An ``OSError`` of the file
system (read-only, full, a file where a directory belongs, a missing parent) may simply propagate:
the CLI reports it the same way, naming the path (``portatrain.errors.file_system_error``). A
command leaves nothing half-written behind when it fails.

``portatrain COMMAND --help`` is generated from these (``portatrain.commands.usage``): the purpose
is the first paragraph of the module docstring, the options and defaults come from the schema.

Adding a command is one file and one line: write ``portatrain/commands/<name>.py`` as above, then
add ``"<name>": "portatrain.commands.<name>"`` to :data:`COMMANDS`. Modules are imported only when
their command runs, so a heavy command costs the others nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

COMMANDS: dict[str, str] = {
    "train": "portatrain.commands.train",  # the default command
    "bench": "portatrain.commands.bench",  # cold start and steady-state throughput
    "export": "portatrain.commands.export",  # a checkpoint -> a Hugging Face directory
    "eval": "portatrain.commands.eval",  # lm-evaluation-harness tasks on a checkpoint
    "generate": "portatrain.commands.generate",  # text from a checkpoint, over a KV cache
    "prepare": "portatrain.commands.prepare",  # tokenize a corpus into memory-mapped shards
    "plan": "portatrain.commands.plan",  # = dry_run=true: size and memory, nothing allocated
    "render": "portatrain.commands.render",  # a SLURM/Kubernetes job for this config
    "submit": "portatrain.commands.submit",  # ... written to the run directory and submitted
    "parity": "portatrain.commands.parity",  # a device against an fp32 CPU run, module by module
    "kernels": "portatrain.commands.kernels",  # kernel overrides: list, parity check
    "audit": "portatrain.commands.audit",  # static scan of code for what breaks off NVIDIA
    "report": "portatrain.commands.report",  # the portability checklist, filled from evidence
    "torchrun": "portatrain.commands.torchrun",  # torchrun, exit 0 after a stop its workers saved
    "lighthouse": "portatrain.commands.lighthouse",  # torchft's lighthouse for replica groups
}
"""Command name -> module. ``dry_run=true`` runs ``plan`` whatever the command."""

DEFAULT_COMMAND = "train"


@dataclass
class CommandContext:
    """What a config command gets besides the config."""

    trainer_cls: type | None = None
    """The ``Trainer`` subclass passed to ``portatrain.cli.main`` (None: ``portatrain.trainer.Trainer``)."""
    overrides: list[str] = field(default_factory=list)
    """The Hydra overrides of the command line, as typed (shorthands expanded)."""


def load_command(name: str) -> ModuleType:
    """The module of command ``name`` (imported now)."""
    return importlib.import_module(COMMANDS[name])


def uses_hydra(module: ModuleType) -> bool:
    """Whether the command wants a composed config (``run``) or raw arguments (``main``)."""
    return bool(getattr(module, "HYDRA", True))


def shorthands(module: ModuleType) -> dict[str, Any]:
    return dict(getattr(module, "SHORTHANDS", {}))


def command_overrides(module: ModuleType) -> list[str]:
    """Overrides the command composes before the user's (``OVERRIDES``, default none)."""
    return list(getattr(module, "OVERRIDES", []))


__all__ = [
    "COMMANDS",
    "DEFAULT_COMMAND",
    "CommandContext",
    "command_overrides",
    "load_command",
    "shorthands",
    "uses_hydra",
]
