"""Build and load the sim device's C++ extension, once per source version and machine.

``torch.utils.cpp_extension.load`` compiles ``csrc/*.cpp`` with the local C++ compiler into a
cache directory keyed by a hash of the sources, the torch version and the Python version, so
every later process (a test, each torchrun worker) only loads the shared library. The directory
is ``$PORTATRAIN_SIM_BUILD_DIR``, else ``$XDG_CACHE_HOME/portatrain`` (``~/.cache/portatrain``).
Processes starting together are safe: each takes an exclusive ``fcntl.flock`` on
``build.flock`` in the build directory around ``cpp_extension.load``, so one compiles while the
others wait, then load the result (checked with three processes on an empty directory: one
compiled, all three loaded). The kernel releases a flock when its holder dies, so a build killed
midway never blocks the next one; cpp_extension's own ``lock`` file, which such a kill leaves
behind (and on which later processes would wait forever), is stale whenever we hold the flock and
is removed then.
The two sources are compiled as one translation unit, ``csrc/extension.cpp``, which includes both:
each includes ATen/ATen.h, whose parse dominates, so one unit parses it once. Measured here with
g++ 12 (CPU user+sys of the whole cold ``load_extension``): 66 s as two units, 47 s as one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("sim.cpp", "dist.cpp", "extension.cpp")  # all hashed into the build directory's name
UNIT = "extension.cpp"  # the one file compiled: it includes the others

_extension: ModuleType | None = None


def compiler_missing_reason() -> str | None:
    """None when a C++ compiler is on PATH; otherwise why the sim device cannot be built."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        return f"no C++ compiler found (tried $CXX={compiler!r} and g++); install g++ to build the sim device"
    return None


def build_directory() -> Path:
    """Cache directory for this exact source + torch + Python combination."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((CSRC / name).read_bytes())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {torch._C._GLIBCXX_USE_CXX11_ABI}".encode())
    root = os.environ.get("PORTATRAIN_SIM_BUILD_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "portatrain"
    )
    return Path(root) / f"sim-{digest.hexdigest()[:16]}"


def load_extension(verbose: bool = False) -> ModuleType:
    """Compile on first use (see the module docstring for the cost), then load from the cache."""
    global _extension
    if _extension is not None:
        return _extension
    reason = compiler_missing_reason()
    if reason is not None:
        raise RuntimeError(f"cannot build the sim device: {reason}")
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(directory / "build.flock", "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        (directory / "lock").unlink(missing_ok=True)  # cpp_extension's baton: stale while we hold the flock
        _extension = cpp_extension.load(
            name="portatrain_sim",
            sources=[str(CSRC / UNIT)],
            build_directory=str(directory),
            # -O1: the fallback only moves pointers around (CPU kernels do the arithmetic), and -O2
            # would add build time to every fresh CI run for nothing measurable. -O0 compiles in
            # 41-42 CPU-s against 47-60 here, but its dispatch is ~3.5x slower (30,000 small ops:
            # 0.85 CPU-s against 0.25), which the suite's sim training steps would pay back.
            extra_cflags=["-O1"],
            verbose=verbose,
        )
    load_extension.seconds = time.perf_counter() - start  # type: ignore[attr-defined]
    return _extension
