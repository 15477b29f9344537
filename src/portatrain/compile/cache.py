"""Compiled graphs that outlive the process (``compile.cache``): :class:`CompileCache`.

Inductor's on-disk caches (FX graph cache, AOTAutograd cache) pointed at ``<run_dir>/compile_cache``
(or ``compile.cache_dir``) and PyTorch's portable cache artifacts (``torch.compiler.save_cache_artifacts``
after each step that compiled, ``load_cache_artifacts`` at start-up), plus the vendor compiler's own
cache where the accelerator adapter names one (``Accelerator.compile_cache_env``). A restart after
preemption then finds every graph compiled; dynamo still traces each (seconds, not minutes).

The artifacts file starts with one JSON line naming the torch that wrote it and the SHA-256 of the
artifacts after it; a file whose artifacts do not match (overwritten, truncated, written by an older
portatrain) or that another torch wrote is not loaded: one warning names it, the graphs are compiled
again and the file rewritten. A cache is only time, so a bad one is skipped rather than fatal. The
checksum finds damage, not forgery: the cache holds pickles and generated code that run in this
process, so a shared ``compile.cache_dir`` must be writable only by whom you would let run code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from portatrain.compile.dynamo import dynamo_graph_count
from portatrain.config import CompileConfig

if TYPE_CHECKING:
    from portatrain.accelerators import Accelerator

logger = logging.getLogger(__name__)


CACHE_DIR_ENV = "PORTATRAIN_COMPILE_CACHE_DIR"
"""Default for ``compile.cache_dir`` when it is unset: one cache shared by every run that sees it
(a team's shared location, or a test session)."""


class CompileCache:
    """Where compiled graphs persist across restarts of a run, and the portable artifacts file.

    Layout of the cache directory (``compile.cache_dir``, default ``<run_dir>/compile_cache``)::

        inductor/                      TORCHINDUCTOR_CACHE_DIR: FX graph + AOTAutograd caches
                                       (and the Triton cache on CUDA, which inductor keeps below it)
        portable_artifacts.bin         torch.compiler.save_cache_artifacts() of this run's compilations
        <vendor>/                      the vendor compiler's cache (adapter's compile_cache_env)

    (``portable_artifacts.bin`` is sealed: a header line with its SHA-256, checked before loading.)

    Inductor's on-disk caches are enough on the same machine; the artifacts file is what survives a
    restart on another node with a node-local cache (``compile.cache_dir`` on local disk) and what
    ``load_cache_artifacts`` hot-loads into it. Both are keyed by torch version, graph, shapes and
    config, so a stale entry is never used, only missed. :meth:`activate` must run before the
    process compiles anything; the Trainer calls it before it builds the model.
    """

    ARTIFACTS = "portable_artifacts.bin"

    def __init__(self, directory: Path, *, vendor_env: dict[str, str] | None = None, is_main: bool = True):
        self.directory = Path(directory)
        self.vendor_env = dict(vendor_env or {})
        self.is_main = is_main
        self.loaded: dict[str, int] = {}
        self._graphs_at_save: int | None = None
        self._saved_env: dict[str, str | None] = {}

    @classmethod
    def for_run(
        cls, compile_cfg: CompileConfig, run_dir: Path, accelerator: Accelerator, *, is_main: bool
    ) -> CompileCache | None:
        """The run's cache, or None when compilation or the cache is off."""
        if not (compile_cfg.enabled and compile_cfg.cache):
            return None
        shared = compile_cfg.cache_dir or os.environ.get(CACHE_DIR_ENV)
        directory = Path(shared) if shared else Path(run_dir) / "compile_cache"
        return cls(directory, vendor_env=accelerator.compile_cache_env(directory), is_main=is_main)

    @property
    def artifacts_path(self) -> Path:
        return self.directory / self.ARTIFACTS

    def activate(self) -> None:
        """Point inductor's (and the vendor's) caches here and hot-load saved portable artifacts."""
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        self.directory.mkdir(parents=True, exist_ok=True)
        # Read by inductor at each compilation (cache_dir_utils.cache_dir), so setting it now works
        # as long as nothing was compiled yet; the two switches are read from the environment only
        # when torch is imported, hence set on the config modules too.
        env = {"TORCHINDUCTOR_CACHE_DIR": str((self.directory / "inductor").resolve()), **self.vendor_env}
        self._saved_env = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        inductor_config.fx_graph_cache = True
        functorch_config.enable_autograd_cache = True
        artifacts, problem = _unsealed(self.artifacts_path)
        if problem is not None:
            logger.warning(
                "compile cache %s: %s; not loaded: the graphs are compiled again and the file rewritten",
                self.artifacts_path,
                problem,
            )
        elif artifacts is not None:
            info = torch.compiler.load_cache_artifacts(artifacts)
            self.loaded = _artifact_counts(info)
            logger.info(
                "compile cache %s: loaded portable artifacts (%s)",
                self.directory,
                ", ".join(f"{k} {v}" for k, v in self.loaded.items()) or "none",
            )
        else:
            logger.info("compile cache %s: empty, graphs compiled now are kept for restarts", self.directory)
        self._graphs_at_save = dynamo_graph_count()

    def deactivate(self) -> None:
        """Restore the environment variables :meth:`activate` changed (the process, and child
        processes it starts later, go back to their own caches)."""
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved_env = {}

    def save_if_compiled(self) -> bool:
        """Write the portable artifacts (rank 0) when graphs were compiled since the last save."""
        graphs = dynamo_graph_count()
        if self._graphs_at_save is None or graphs == self._graphs_at_save:
            return False
        self._graphs_at_save = graphs
        if not self.is_main:
            return False
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        artifacts, info = saved
        tmp = self.artifacts_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(_sealed(artifacts))
        tmp.replace(self.artifacts_path)  # atomic: a restart never reads half a file
        logger.info(
            "compile cache: saved %s (%.1f MB; %s)",
            self.artifacts_path,
            len(artifacts) / 1e6,
            ", ".join(f"{k} {v}" for k, v in _artifact_counts(info).items()),
        )
        return True


_FORMAT = "portatrain-compile-artifacts/1"


def _sealed(artifacts: bytes) -> bytes:
    """``artifacts`` behind their header line: the format, the torch that wrote them, their SHA-256."""
    header = {"format": _FORMAT, "torch": torch.__version__, "sha256": hashlib.sha256(artifacts).hexdigest()}
    return json.dumps(header).encode() + b"\n" + artifacts


def _unsealed(path: Path) -> tuple[bytes | None, str | None]:
    """``(artifacts, None)`` of a sound file at ``path``; ``(None, why)`` when it must not be loaded;
    ``(None, None)`` when there is none."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    line, _, artifacts = data.partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        return None, "it has no portatrain checksum header (written by an older portatrain, or not ours)"
    if header.get("sha256") != hashlib.sha256(artifacts).hexdigest():
        return None, "its SHA-256 does not match the one written with it (the file is damaged)"
    if header.get("torch") != torch.__version__:
        return None, f"it was written by torch {header.get('torch')}, this is torch {torch.__version__}"
    return artifacts, None


def _artifact_counts(info: Any) -> dict[str, int]:
    """``{kind: count}`` of a ``torch.compiler.CacheInfo`` (empty for None)."""
    if info is None:
        return {}
    counts = {}
    for name in dir(info):
        value = getattr(info, name) if name.endswith("_artifacts") else None
        if isinstance(value, list) and value:
            counts[name.removesuffix("_artifacts")] = len(value)
    return counts
