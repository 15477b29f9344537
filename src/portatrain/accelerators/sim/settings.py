"""What the sim device is in this process: its name and its environment settings, checked up front.

Every setting of the sim device comes from the environment (the table below); :func:`settings_problems`
checks them all before anything is built or installed, so a bad value is one error naming the
variable, what it accepts and the fix -- not a failed build, and not a half-installed device.

=========================  ===================================================================
``SIM_DEVICE_COUNT``       devices per process, 1 to :data:`MAX_DEVICES` (default 4)
``SIM_MEMORY_CAPACITY``    per-device capacity, ``512MiB``, ``2GB``, ``1073741824``; unset: unlimited
``SIM_COUNTERS_MODE``      ``count`` (default), ``warn`` or ``raise`` (:mod:`.counters`)
``SIM_UNSUPPORTED_OPS``    comma-separated ops marked unsupported (``aten::nonzero,...``)
``SIM_UNSUPPORTED_ACTION`` what such an op does: ``count`` (default), ``warn`` or ``error``
``SIM_OP_PROFILE``         op coverage: ``tpu``, ``neuron`` or a profile file (:mod:`.op_profiles`)
``PORTATRAIN_SIM_AS``      the device's name: ``sim`` (default), ``tpu`` or ``neuron`` (impersonation,
                           with that device's default dtype, bf16)
=========================  ===================================================================

This module sits below ``runtime`` and ``inductor`` (both ask it for the device's name) and imports
nothing of the sim package but :mod:`.counters`' constants, :mod:`.op_profiles` and :mod:`.errors`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from portatrain.accelerators.sim.counters import (
    ACTIONS,
    MODE_ENV,
    MODES,
    UNSUPPORTED_ACTION_ENV,
    UNSUPPORTED_ENV,
)
from portatrain.accelerators.sim.errors import SimSettingsError
from portatrain.accelerators.sim.op_profiles import PROFILE_ENV, profile_problem

SIM_AS_ENV = "PORTATRAIN_SIM_AS"
"""Names the device in this process: ``sim`` (default), ``tpu`` or ``neuron`` (impersonation)."""
ALLOWED_NAMES = ("sim", "tpu", "neuron")
CAPACITY_ENV = "SIM_MEMORY_CAPACITY"
"""Per-device memory capacity (``512MiB``, ``2GB``, ``1073741824``); unset means unlimited."""
DEVICE_COUNT_ENV = "SIM_DEVICE_COUNT"
DEFAULT_DEVICE_COUNT = 4
MAX_DEVICES = 64
"""``kMaxDevices`` in ``csrc/sim.cpp``."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}

_installed: str | None = None


def parse_bytes(text: str) -> int:
    """``"512MiB"`` -> 536870912. Raises ValueError naming the value and the accepted forms."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{CAPACITY_ENV}={text!r} is not a size; write bytes or a number with a unit "
            f"({', '.join(u for u in _UNITS if u)}), e.g. 512MiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def settings_problems(environ: Mapping[str, str] = os.environ, name: str | None = None) -> list[str]:
    """Every problem of the sim's environment settings (and of ``name``, the device's name when one
    is asked for explicitly), each with its fix."""
    problems = []
    count = environ.get(DEVICE_COUNT_ENV, "").strip()
    if count and not (count.isdigit() and 1 <= int(count) <= MAX_DEVICES):
        problems.append(
            f"{DEVICE_COUNT_ENV}={count!r} is not a device count from 1 to {MAX_DEVICES}; set it to the "
            f"number of sim devices a process sees (unset: {DEFAULT_DEVICE_COUNT})"
        )
    capacity = environ.get(CAPACITY_ENV)
    if capacity:
        try:
            if parse_bytes(capacity) <= 0:
                problems.append(
                    f"{CAPACITY_ENV}={capacity!r} is no memory at all; give a size such as 512MiB, "
                    f"or unset {CAPACITY_ENV} for unlimited memory"
                )
        except ValueError as exc:
            problems.append(f"{exc}; or unset {CAPACITY_ENV} for unlimited memory")
    mode = environ.get(MODE_ENV)
    if mode is not None and mode not in MODES:
        problems.append(f"{MODE_ENV}={mode!r} is not one of {', '.join(MODES)}; set one of them or unset it")
    action = environ.get(UNSUPPORTED_ACTION_ENV)
    if action is not None and action not in ACTIONS:
        problems.append(
            f"{UNSUPPORTED_ACTION_ENV}={action!r} is not one of {', '.join(ACTIONS)} (what an op listed in "
            f"{UNSUPPORTED_ENV} does); set one of them or unset it"
        )
    profile = profile_problem(environ.get(PROFILE_ENV, ""))
    if profile is not None:
        problems.append(profile)
    given = name if name is not None else environ.get(SIM_AS_ENV)
    if given is not None and given not in ALLOWED_NAMES:
        where = f"the sim device's name {given!r}" if name is not None else f"{SIM_AS_ENV}={given!r}"
        problems.append(
            f"{where} must be one of {', '.join(ALLOWED_NAMES)}; unset {SIM_AS_ENV} for the plain sim device"
        )
    return problems


def check_settings(environ: Mapping[str, str] = os.environ, name: str | None = None) -> None:
    """Raise :class:`SimSettingsError` listing every problem of :func:`settings_problems`."""
    problems = settings_problems(environ, name)
    if problems:
        raise SimSettingsError("device=sim: " + "; ".join(problems))


def device_name() -> str:
    """The device type this process uses (or will use) for the sim: ``PORTATRAIN_SIM_AS`` or ``sim``."""
    return _installed or os.environ.get(SIM_AS_ENV) or "sim"


def installed() -> str | None:
    """The name the sim was installed under in this process, or None."""
    return _installed


def mark_installed(name: str) -> None:
    """Record that the sim device is installed as ``name`` (``runtime.install`` calls this once)."""
    global _installed
    _installed = name
