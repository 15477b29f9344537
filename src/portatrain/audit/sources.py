"""Which files a run's own code lives in, so the report can audit "the code in use".

portatrain's modules are audited by its own test suite; what varies per run is the research
code around it: the ``Trainer`` subclass passed to ``portatrain.cli.main`` (and any user-defined
base classes between it and portatrain's ``Trainer``).
"""

from __future__ import annotations

import inspect
from pathlib import Path


def trainer_sources(trainer_cls: type | None) -> list[Path]:
    """Source files of ``trainer_cls`` and of its bases that are not part of portatrain, in MRO order.

    ``None`` (the stock Trainer) and classes without a source file (built in a REPL) give ``[]``.
    """
    if trainer_cls is None:
        return []
    files: list[Path] = []
    for cls in inspect.getmro(trainer_cls):
        module = cls.__module__ or ""
        if module == "builtins" or module == "portatrain" or module.startswith("portatrain."):
            continue
        try:
            source = inspect.getsourcefile(cls)
        except TypeError:  # a class defined in C or without a module file
            source = None
        if source is not None and Path(source).is_file() and Path(source) not in files:
            files.append(Path(source))
    return files
