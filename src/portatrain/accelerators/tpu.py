"""Google TPUs through TorchTPU (``torch_tpu``), a native PrivateUse1 device named ``tpu``.

Every TorchTPU-specific name below was checked against the torch_tpu 0.2.0 wheel from PyPI
(``pip download --no-deps torch-tpu``, read, never installed); the file each comes from is
cited next to it. Not run on a TPU: see the device table in docs/devices.md for what that leaves open.

What the wheel says, and how this adapter follows it:

- Device, runtime, memory and RNG go through the generic ``torch.accelerator`` API (base class):
  TorchTPU closes ``torch.tpu.device_count/synchronize/set_device/...`` to callers outside
  torch from torch 2.11 on (``torch_tpu/_internal/device/_device_module.py``).
- One device per worker process: ``set_device`` "primarily validates that the given device
  index matches the device index assigned to the current process ... switching the active
  device within a single process is not supported" (``_device_module.py``). The adapter drives
  the index the process is bound to (``torch.accelerator.current_device_index()``), never
  ``LOCAL_RANK``.
- ``torch_tpu`` registers the ``tpu`` device only when it finds a TPU on the PCI bus
  (``torch_tpu/_loader.py`` ``load``: ``if hardware.get_tpu_device_count(): _init_device("tpu")``);
  elsewhere ``torch.accelerator.current_accelerator()`` stays None and discovery reports 0 devices.
"""

from __future__ import annotations

import torch

from portatrain.accelerators.base import Accelerator, lookup_peak_tflops

# Dense bf16 peak TFLOP/s of ONE TORCH DEVICE, matched against torch.tpu.get_device_name()
# ("TPU v4", "TPU v5e", "TPU v5p", "TPU v6e", "TPU v7": torch_tpu/_internal/utils/hardware.py
# _PCI_DEVICE_ID_TO_NAME). Per-chip figures are Google's (cloud.google.com/tpu/docs/{v4,v5e,v5p,
# v6e,tpu7x}, the same numbers as hardware.py _BF16_FLOPS_PER_CHIP); a chip is one device except
# TPU v7, which exposes its two TensorCores as two devices (hardware.py _DEVICES_PER_CHIP = {V7: 2},
# "one device reports ~96 GB of the 192 GB chip"), so v7 is 2307 / 2. TPUs publish no fp32 matmul
# rate (the MXU runs fp32 as several bf16 passes): fp32 runs report no MFU.
TPU_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("TPU v7",), {"bfloat16": 2307.0 / 2}),
    (("TPU v6e",), {"bfloat16": 918.0}),
    (("TPU v5p",), {"bfloat16": 459.0}),
    (("TPU v5e",), {"bfloat16": 197.0}),
    (("TPU v4",), {"bfloat16": 275.0}),
)


class TPUAccelerator(Accelerator):
    name = "tpu"
    device_type = "tpu"  # torch_tpu/_loader.py: torch.utils.rename_privateuse1_backend("tpu")
    vendor_module = "torch_tpu"
    install_hint = (
        "on a Cloud TPU VM run `pip install 'portatrain[tpu]'` (TorchTPU; torch>=2.11,<=2.15); never "
        "install torch_tpu on a host without TPUs: it loads on every `import torch`"
    )
    # torch_tpu/_loader.py registers "tpu_dist" (and the alias "tpu") for device "tpu" only
    # (register_backend(..., devices=["tpu"])): CPU tensors need gloo beside it.
    dist_backend = "cpu:gloo,tpu:tpu_dist"
    # torch_tpu/_loader.py: lookup_backend("tpu"); its torch.compile patch also defaults TPU
    # backends to dynamic=False, which static_shapes asks for explicitly.
    compile_backend = "tpu"
    static_shapes = True

    def select_index(self, requested: int, visible: int) -> int:
        """The index this process is bound to; TorchTPU refuses any other (``set_device``)."""
        return int(torch.accelerator.current_device_index())

    def device_name(self) -> str:
        """``torch.tpu.get_device_name()``, e.g. "TPU v6e": read from the PCI IDs without starting
        the runtime (hardware.py ``get_tpu_device_name``); "TPU" for an unknown generation.

        An experimental API in the wheel (it warns once); the legacy-closed ones are not used.
        """
        module = getattr(torch, self.device_type, None)
        get_name = getattr(module, "get_device_name", None)
        if get_name is None:
            return "TPU of unknown generation (torch.tpu.get_device_name is missing)"
        return str(get_name())

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        tflops = lookup_peak_tflops(TPU_PEAK_TFLOPS, self.device_name(), str(dtype).removeprefix("torch."))
        return None if tflops is None else tflops * 1e12

    def low_precision_matmuls(self) -> dict[str, str]:
        """FP8 on TPU7x (Ironwood) only: Google's table gives it 4614 FP8 TFLOPs per chip against 2307
        BF16, and v5p and v6e the same figure for both (459, 918: no FP8 units;
        https://docs.cloud.google.com/tpu/docs/tpu7x, "Peak compute per chip (FP8)"). MXFP8: no
        public statement found for any generation, so not declared. Not run on a TPU: whether
        TorchTPU lowers ``torch._scaled_mm`` (what torchao's FP8 calls) is untested."""
        return {"float8": "native"} if "TPU v7" in self.device_name() else {}

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        # TorchTPU registers a Kineto backend for its PrivateUse1 device
        # (torch_tpu/_loader.py: profiler.register_kineto_backend()).
        activity = torch.profiler.ProfilerActivity
        return [activity.CPU, activity.PrivateUse1]
