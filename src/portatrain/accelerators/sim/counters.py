"""Counters of what TPUs and Trainium punish, kept by the sim device, with the first stack of each.

Every event has a key; the part before the first ``:`` is its category:

==========================================  =========================================================
``sync:item``                               ``.item()``, ``float(t)``, ``bool(t)``, ``if t:``
``sync:d2h``                                device-to-host copy (``.cpu()``, ``.tolist()``, printing)
``sync:data_dependent:<op>``                output shape depends on values (``nonzero``,
                                            ``masked_select``, ``unique``; ``aten::index.Tensor[bool
                                            mask]`` for ``x[mask]``)
``sync:scalar_result:<op>``                 op returning a Python scalar (``torch.equal``)
``sync:synchronize``                        explicit ``synchronize`` of device, stream or event
``mixed_device:<op>``                       op on sim tensors with a non-scalar CPU tensor, or two
                                            sim devices
``fallback:<op>``                           op outside the active op-coverage profile (:func:`set_profile`,
                                            ``SIM_OP_PROFILE``) or marked unsupported (:func:`mark_unsupported`):
                                            it really runs through ``at::native::cpu_fallback``
``op:<op>``                                 every op reaching the device, while the census is on
                                            (:func:`set_census`; information, never an offence)
``transfer:h2d``                            host-to-device copy (information, never an offence)
==========================================  =========================================================

Op names are those that reach the device, with overload: structured ops often arrive as their
``.out`` variant and foreach ops per tensor, so mark what :func:`snapshot` shows.

API for the Trainer's runtime audit (one call per logged step)::

    from portatrain.accelerators.sim import counters
    counts = counters.take()            # snapshot since the last take()/reset(), then reset
    counts.syncs                        # {"item": 1, "d2h": 2, "data_dependent:aten::nonzero": 1}
    counts.fallbacks, counts.mixed_device  # {"aten::foo.out": 3}
    counts.ops                          # the op census (when on): {"aten::mm.out": 12, ...}
    counts.first_stacks["sync:item"]    # Python stack of the first occurrence since the reset
    counts.offences()                   # every key except transfers; counts.format() for a log line

For tests::

    with counters.expect_no_sync_or_fallback():            # fails at exit, listing each offence
        step()
    with counters.expect_no_sync_or_fallback(strict=True): # raises at the offending line
        step()

Modes for a whole run (:func:`set_mode` or ``SIM_COUNTERS_MODE``): ``count`` (default), ``warn``
(one warning per key, with its stack) or ``raise`` (RuntimeError at the first offence, with its stack).
An op marked unsupported with the action ``error`` raises :class:`~.errors.SimUnsupportedOpError`
(a RuntimeError and a user error: one line naming the op and where it was called).
Outside :func:`install` (no sim device in the process) every function here works and counts nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from portatrain.accelerators.sim.errors import SimUnsupportedOpError
from portatrain.accelerators.sim.op_profiles import PROFILE_ENV, OpProfile

MODES = ("count", "warn", "raise")
ACTIONS = ("count", "warn", "error")
MODE_ENV = "SIM_COUNTERS_MODE"
UNSUPPORTED_ENV = "SIM_UNSUPPORTED_OPS"
"""Comma-separated ops marked unsupported at install, e.g. ``aten::nonzero,aten::_foreach_mul_.List``."""
UNSUPPORTED_ACTION_ENV = "SIM_UNSUPPORTED_ACTION"
"""What an unsupported op does: ``count`` (default), ``warn`` or ``error``."""

OFFENCE_CATEGORIES = ("sync", "mixed_device", "fallback")

_ext: Any = None
_lock = threading.Lock()
_mode = "count"
_fallback_actions: dict[str, str] = {}
_profile: OpProfile | None = None
_profile_action = "count"
_first_stacks: dict[str, str] = {}
_scopes: list[_Scope] = []
_pause_depth = 0


class SimOffenceError(AssertionError):
    """Raised by :func:`expect_no_sync_or_fallback` when the block synced, mixed devices or fell back."""


@dataclass
class Counts:
    """Counter values over an interval, by category, with the first stack of each key."""

    syncs: dict[str, int] = field(default_factory=dict)
    """Host synchronizations by kind (``item``, ``d2h``, ``synchronize``, ``data_dependent:<op>``, …)."""
    mixed_device: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)
    transfers: dict[str, int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)
    """The op census (:func:`set_census`): every op that reached the device, by name with overload."""
    first_stacks: dict[str, str] = field(default_factory=dict)
    """Key (``sync:item``) -> formatted Python stack of its first occurrence in the interval."""

    @classmethod
    def from_keys(cls, counts: dict[str, int], stacks: dict[str, str]) -> Counts:
        out = cls(first_stacks=dict(stacks))
        for key, n in counts.items():
            category, _, kind = key.partition(":")
            target = {
                "sync": out.syncs,
                "mixed_device": out.mixed_device,
                "fallback": out.fallbacks,
                "transfer": out.transfers,
                "op": out.ops,
            }.get(category)
            if target is not None and n:
                target[kind] = n
        return out

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def total_fallbacks(self) -> int:
        return sum(self.fallbacks.values())

    def offences(self) -> dict[str, int]:
        """Every counted key that a real accelerator punishes, as ``category:kind`` -> count."""
        out = {f"sync:{k}": n for k, n in self.syncs.items()}
        out.update({f"mixed_device:{k}": n for k, n in self.mixed_device.items()})
        out.update({f"fallback:{k}": n for k, n in self.fallbacks.items()})
        return out

    def format(self, stacks: bool = False) -> str:
        """One line per offence (``sync:item x3``), each followed by its first stack if asked."""
        lines = []
        for key, n in sorted(self.offences().items()):
            lines.append(f"{key} x{n}")
            if stacks and key in self.first_stacks:
                lines.append("  first occurrence:\n" + _indent(self.first_stacks[key], "    "))
        return "\n".join(lines) if lines else "no host syncs, mixed-device ops or fallbacks"


@dataclass
class _Scope:
    start: dict[str, int]
    stacks: dict[str, str] = field(default_factory=dict)
    strict: bool = False
    allow: tuple[str, ...] = ()


def _indent(text: str, prefix: str) -> str:
    return "".join(prefix + line for line in text.splitlines(keepends=True))


def _stack() -> str:
    # Drop the frames of this module: the stack ends at the user's offending line.
    frames = [f for f in traceback.extract_stack() if not f.filename.endswith(("counters.py",))]
    if not frames:
        return (
            "(no Python stack: the op ran on an autograd worker thread during backward; "
            "look for it in the backward of the module that produced the gradient)\n"
        )
    return "".join(traceback.format_list(frames[-12:]))


def _is_offence(key: str) -> bool:
    return key.partition(":")[0] in OFFENCE_CATEGORIES


def _allowed(key: str, allow: tuple[str, ...]) -> bool:
    return any(key.startswith(prefix) for prefix in allow)


def _on_event(key: str, first: bool) -> str | None:
    """Called from C++ on a key's first occurrence, or on every one while a scope/mode needs it.

    Returns an error message for C++ to raise, or None.
    """
    stack: str | None = None
    with _lock:
        if key not in _first_stacks:
            stack = _stack()
            _first_stacks[key] = stack
        for scope in _scopes:
            if key not in scope.stacks:
                stack = stack or _stack()
                scope.stacks[key] = stack
    if not _is_offence(key):
        return None
    action = _mode
    if key.startswith("fallback:"):
        op = key[len("fallback:") :]
        marked = _fallback_actions.get(op) or _fallback_actions.get(op.split(".")[0]) or _profile_action
        if marked == "error":
            raise SimUnsupportedOpError(_unsupported_message(key, op))
        action = {"count": "count", "warn": "warn"}[marked]
    strict = any(s.strict and not _allowed(key, s.allow) for s in _scopes)
    if action == "raise" or strict:
        return f"[sim] {key} is not allowed here (a TPU or Trainium would stall or fall back):\n" + (
            stack or _first_stacks.get(key, "")
        )
    if action == "warn" and first:
        warnings.warn(f"[sim] {key}, first at:\n{stack or _first_stacks.get(key, '')}", stacklevel=2)
    return None


def _unsupported_message(key: str, op: str) -> str:
    """One line: the op, the innermost line of the user's code (not torch's) that called it, the fix."""
    frames = [f for f in traceback.extract_stack() if not f.filename.endswith("counters.py")]
    torch_module = sys.modules.get("torch")
    torch_dir = os.path.dirname(torch_module.__file__ or "") if torch_module else None
    own = [f for f in frames if not (torch_dir and f.filename.startswith(torch_dir + os.sep))]
    frame = (own or frames)[-1] if frames else None
    where = (
        f"called from {frame.filename}:{frame.lineno} in {frame.name}"
        if frame
        else "called during backward (no Python stack: look in the backward of the module that produced the gradient)"
    )
    if _profile is not None and op not in _fallback_actions and op.split(".")[0] not in _fallback_actions:
        why = f"is outside the op profile {_profile.name!r} ({PROFILE_ENV}), with the action error"
    else:
        why = (
            f"is marked unsupported with the action error ({UNSUPPORTED_ENV}, {UNSUPPORTED_ACTION_ENV}=error)"
        )
    return (
        f"[sim] {key}: {op} {why} and was {where}; avoid the op there, or set "
        f"{UNSUPPORTED_ACTION_ENV}=count (or warn) to count its CPU fallbacks and go on"
    )


def _attach(ext: Any) -> None:
    """Connect to the installed extension (called by runtime.install)."""
    global _ext
    _ext = ext
    ext.set_callback(_on_event)
    # An unsupported op under the action error raises SimUnsupportedOpError (a UserError) from
    # inside the op; the extension lets UserErrors through with their type.
    set_mode(os.environ.get(MODE_ENV, "count"))
    action = os.environ.get(UNSUPPORTED_ACTION_ENV, "count")
    ops = [op.strip() for op in os.environ.get(UNSUPPORTED_ENV, "").split(",") if op.strip()]
    if ops:
        mark_unsupported(ops, action)
    profile = os.environ.get(PROFILE_ENV, "")
    if profile not in ("", "none"):
        from portatrain.accelerators.sim import op_profiles

        set_profile(op_profiles.load(profile), action)
    import atexit

    # Drop the callback before the interpreter goes away: a late op must not call into a dead Python.
    atexit.register(ext.set_callback, None)


def _sync_notify() -> None:
    if _ext is not None:
        needs_all = (
            bool(_scopes)
            or _mode != "count"
            or _profile_action != "count"
            or any(a != "count" for a in _fallback_actions.values())
        )
        _ext.set_notify_all(needs_all)


def active() -> bool:
    """Whether the sim device is installed in this process (so counters count)."""
    return _ext is not None


def set_mode(mode: str) -> None:
    """``count`` (default), ``warn`` (warn once per key) or ``raise`` (error at the first offence)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"sim counters mode {mode!r} is not one of {', '.join(MODES)}")
    _mode = mode
    _sync_notify()


def mark_unsupported(ops: Iterable[str], action: str = "count") -> None:
    """Treat ``ops`` as unsupported on the device: each call counts as ``fallback:<op>``.

    ``ops`` are dispatcher names, ``aten::nonzero`` (every overload) or ``aten::add.out`` (one
    overload). ``action``: ``count``, ``warn`` (once per op) or ``error`` (RuntimeError at the call).
    Replaces any previous list.
    """
    if action not in ACTIONS:
        raise ValueError(f"unsupported-op action {action!r} is not one of {', '.join(ACTIONS)}")
    ops = [op if "::" in op else f"aten::{op}" for op in ops]
    _fallback_actions.clear()
    _fallback_actions.update(dict.fromkeys(ops, action))
    if _ext is not None:
        _ext.set_unsupported(ops)
    _sync_notify()


def set_profile(profile: OpProfile | None, action: str = "count") -> None:
    """Make ``profile`` the device's op coverage: every other aten op falls back to the CPU and counts
    as ``fallback:<op>`` with ``action`` (``count``, ``warn``, ``error``: the backend rejects it).
    None: no profile, every op native. Ops :func:`mark_unsupported` lists fall back either way."""
    global _profile, _profile_action
    if action not in ACTIONS:
        raise ValueError(f"unsupported-op action {action!r} is not one of {', '.join(ACTIONS)}")
    _profile, _profile_action = profile, action
    if _ext is not None:
        _ext.set_leaf_ops([])  # the previous profile's first: leaf_composites() skips registered ops
        _ext.set_leaf_ops(profile.leaf_composites() if profile is not None else [])
        _ext.set_native(sorted(profile.native) if profile is not None else None)
    _sync_notify()


def active_profile() -> OpProfile | None:
    """The op-coverage profile in force (None: every op runs natively)."""
    return _profile


def set_census(on: bool) -> None:
    """Count every op that reaches the device as ``op:<op>`` (the runtime audit turns it on)."""
    if _ext is not None:
        _ext.set_census(on)


def unsupported_ops() -> dict[str, str]:
    """The ops marked unsupported and their action."""
    return dict(_fallback_actions)


def snapshot() -> Counts:
    """Counts since the last :func:`reset` (empty when the sim device is not installed)."""
    if _ext is None:
        return Counts()
    with _lock:
        stacks = dict(_first_stacks)
    return Counts.from_keys(_ext.counts(), stacks)


def reset() -> None:
    """Zero every counter and forget first stacks; the next occurrence of each key is a first again."""
    if _ext is None:
        return
    with _lock:
        _ext.reset_counts()
        _first_stacks.clear()


def take() -> Counts:
    """:func:`snapshot` then :func:`reset`: the per-step reading the runtime audit logs."""
    counts = snapshot()
    reset()
    return counts


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Count nothing inside: for logging and checkpointing code that syncs on purpose."""
    global _pause_depth
    if _ext is None:
        yield
        return
    with _lock:
        _pause_depth += 1
        _ext.set_counting(False)
    try:
        yield
    finally:
        with _lock:
            _pause_depth -= 1
            if _pause_depth == 0:  # nested pauses: only the outermost resumes counting
                _ext.set_counting(True)


@contextlib.contextmanager
def expect_no_sync_or_fallback(strict: bool = False, allow: Iterable[str] = ()) -> Iterator[Counts]:
    """Fail if the block syncs with the host, mixes devices or calls an unsupported op.

    ``strict=False`` runs the whole block and raises :class:`SimOffenceError` at exit listing every
    offence with its count and the stack of its first occurrence; ``strict=True`` raises a
    RuntimeError at the offending op instead. ``allow`` lists key prefixes that are fine here
    (``("sync:item",)``). Yields the block's :class:`Counts`, filled in at exit.
    Fails when the sim device is not installed: the check would otherwise pass vacuously.
    """
    if _ext is None:
        raise RuntimeError(
            "expect_no_sync_or_fallback() needs the sim device in this process: call "
            "portatrain.accelerators.sim.install() (or run with device=sim) first"
        )
    scope = _Scope(start=_ext.counts(), strict=strict, allow=tuple(allow))
    result = Counts()
    with _lock:
        _scopes.append(scope)
    _sync_notify()
    try:
        yield result
    finally:
        with _lock:
            _scopes.remove(scope)
        _sync_notify()
        end = _ext.counts()
        delta = {k: n - scope.start.get(k, 0) for k, n in end.items() if n - scope.start.get(k, 0) > 0}
        filled = Counts.from_keys(delta, scope.stacks)
        result.__dict__.update(filled.__dict__)
    bad = {k: n for k, n in result.offences().items() if not _allowed(k, scope.allow)}
    if bad:
        shown = Counts.from_keys(bad, scope.stacks)
        raise SimOffenceError("the block did what a TPU or Trainium punishes:\n" + shown.format(stacks=True))
