"""What dynamo records process-wide, read for the compile cache and the recompile guard.

Counting uses dynamo's process-wide records (``torch._dynamo.utils.counters`` and
``guard_failures``), taken as differences from a starting point, so other compiled code in the same
process shows up in the count too. Dynamo caches compiled code per Python code object: a second
model of the same class in one process reuses the first one's graphs.
"""

from __future__ import annotations

from typing import Any


def dynamo_graph_count() -> int:
    """Graphs dynamo has compiled in this process (all functions, all backends)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def guard_failure_counts() -> dict[Any, int]:
    """Guard failures recorded so far, per code object (to diff against with :func:`new_guard_failures`)."""
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in guard_failures.items()}


def new_guard_failures(before: dict[Any, int]) -> list[str]:
    """The guard failures recorded since ``before`` (a :func:`guard_failure_counts`)."""
    from torch._dynamo.utils import guard_failures

    return [r for code, reasons in guard_failures.items() for r in reasons[before.get(code, 0) :]]


def guard_lines(message: str) -> list[str]:
    """The ``- 0/1: tensor 'x' size mismatch ...`` lines of dynamo's recompile message."""
    return [line.strip()[2:] for line in message.splitlines() if line.strip().startswith("- ")]
