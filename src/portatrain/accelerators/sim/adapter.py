"""``device=sim``: the accelerator adapter for portatrain's simulated device.

Selecting it (``device=sim``, or ``resolve_accelerator("sim")``) builds/loads the C++ extension
and installs the device; merely importing this module does neither. Not part of ``device=auto``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from portatrain.accelerators.base import Accelerator
from portatrain.errors import UserError

if TYPE_CHECKING:
    from portatrain.accelerators.sim.counters import Counts


class SimAccelerator(Accelerator):
    name = "sim"
    install_hint = "install a C++ compiler (g++) so the sim device can be built on first use"
    compile_backend = "aot_eager"
    static_shapes = True  # like the TPU and Neuron compilers: one graph per shape
    fused_adamw = False
    deterministic_kernels = True  # the CPU's kernels on device memory

    @property
    def device_type(self) -> str:  # type: ignore[override]
        """``sim``, or the impersonated name from ``PORTATRAIN_SIM_AS`` (``tpu``, ``neuron``)."""
        from portatrain.accelerators.sim.settings import device_name

        return device_name()

    @property
    def default_dtype(self) -> torch.dtype:  # type: ignore[override]
        """``trainer.dtype=auto``'s precision: fp32 as plain ``sim`` (its kernels are the CPU's, where
        bf16 matmuls are slow), the impersonated device's own default (bf16) as ``tpu`` or
        ``neuron``, so an impersonating run trains in the precision that device's users get."""
        from portatrain.accelerators.neuron import NeuronAccelerator
        from portatrain.accelerators.tpu import TPUAccelerator

        impersonated = {"tpu": TPUAccelerator, "neuron": NeuronAccelerator}.get(self.device_type)
        return torch.float32 if impersonated is None else impersonated.default_dtype

    @property
    def dist_backend(self) -> str:  # type: ignore[override]
        """Gloo for CPU tensors and the sim's own backend (gloo over aliases) for device tensors."""
        from portatrain.accelerators.sim.distributed import BACKEND_NAME

        return f"cpu:gloo,{self.device_type}:{BACKEND_NAME}"

    def vendor_installed(self) -> bool:
        return True

    def load(self) -> None:
        from portatrain.accelerators.sim.runtime import install

        install()

    def unavailable_reason(self) -> str | None:
        """Why the sim cannot be built or loaded (the install hint's case: no C++ compiler, a
        failed build). A bad setting is not such a reason: it raises :class:`SimSettingsError`,
        whose message carries the setting's own fix."""
        from portatrain.accelerators.sim._build import compiler_missing_reason
        from portatrain.accelerators.sim.errors import SimSettingsError
        from portatrain.accelerators.sim.settings import DEVICE_COUNT_ENV, check_settings

        check_settings()
        reason = compiler_missing_reason()
        if reason is not None:
            return reason
        try:
            self.load()
        except UserError:
            raise
        except Exception as exc:  # a failed build surfaces as any exception type
            return f"building or loading the sim device failed: {type(exc).__name__}: {exc}"
        count = self.device_count()
        if not 0 <= self.index < count:
            raise SimSettingsError(
                f"device=sim: {count} sim device(s) ({DEVICE_COUNT_ENV}), need index {self.index} "
                f"(device.index, else LOCAL_RANK); set {DEVICE_COUNT_ENV}={self.index + 1}, "
                f"set device.index below {count} or launch at most {count} processes per host"
            )
        return None

    def device_name(self) -> str:
        return f"portatrain sim ({self.device_type}, CPU kernels)"

    def take_runtime_counters(self) -> Counts:
        """Host syncs, mixed-device ops and unsupported-op fallbacks since the last call, each with
        the stack of its first occurrence; resets them (see :mod:`portatrain.accelerators.sim.counters`)."""
        from portatrain.accelerators.sim import counters

        return counters.take()
