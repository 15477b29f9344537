"""The sim device's user errors: each is a :class:`~portatrain.errors.UserError`, so the CLI prints
it as one line (exit 2), and keeps the built-in type code written for a real device catches.

* :class:`SimSettingsError` -- a sim setting cannot be used (:mod:`.settings`); its fix is the setting.
* :class:`SimOutOfMemoryError` -- an allocation over ``SIM_MEMORY_CAPACITY`` (raised by the
  extension's allocator, ``csrc/sim.cpp``); still a ``torch.OutOfMemoryError``.
* :class:`SimUnsupportedOpError` -- an op marked unsupported with the action ``error`` was called
  (raised by :mod:`.counters` from inside the op); still a ``RuntimeError``.
"""

from __future__ import annotations

import torch

from portatrain.accelerators.base import DeviceUnavailableError
from portatrain.errors import UserError


class SimSettingsError(DeviceUnavailableError):
    """A sim setting (an environment variable, or the device index) cannot be used; the message
    names the value and its fix, which is the setting itself (a compiler would not help)."""


class SimOutOfMemoryError(UserError, torch.OutOfMemoryError):
    """An allocation would exceed ``SIM_MEMORY_CAPACITY``; the message names the capacity and the fix."""


class SimUnsupportedOpError(UserError, RuntimeError):
    """An op marked unsupported under the action ``error`` was called; the message names the op,
    where it was called and the fix."""
