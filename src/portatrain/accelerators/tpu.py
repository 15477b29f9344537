"""Google TPUs through TorchTPU (``torch_tpu``), a native PrivateUse1 device named ``tpu``.

The names used here (device type ``tpu``, compile backend ``tpu``) come from the launch
articles in ``shared/reference`` and are unverified against a real TPU host; every such call
lives in this file so fixing one is a one-line change. We deliberately use only the generic
``torch.<device_type>`` accessors (``device_count``, ``synchronize``, ``memory_allocated``)
that PrivateUse1 backends register, and fall back to empty statistics when absent.
"""

from __future__ import annotations

import os

import torch

from portatrain.accelerators.base import Accelerator, lookup_peak_tflops

TPU_CHIP_ENV = "PORTATRAIN_TPU_CHIP"
"""Names the TPU generation for the peak-FLOPs table (``v5e``, ``v5p``, ``v6e``)."""

# Dense bf16 peak TFLOP/s per chip, from Google Cloud's TPU system-architecture pages
# (cloud.google.com/tpu/docs/v5e, /v5p, /v6e: "Peak compute per chip (bf16)"). TPUs publish no
# fp32 matmul rate (the MXU runs fp32 as several bf16 passes), so fp32 runs report no MFU.
# A v5e/v6e chip is one TensorCore and a v5p chip one megacore, so one torch device is one chip
# (unverified for TorchTPU: if it exposes a fraction of a chip, set metrics.peak_tflops).
TPU_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("v6e", "trillium"), {"bfloat16": 918.0}),
    (("v5p",), {"bfloat16": 459.0}),
    (("v5e", "v5lite"), {"bfloat16": 197.0}),  # accelerator types spell v5e "v5litepod-N"
)


class TPUAccelerator(Accelerator):
    name = "tpu"
    device_type = "tpu"
    vendor_module = "torch_tpu"
    install_hint = (
        "on a Cloud TPU VM run `pip install 'portatrain[tpu]'` (TorchTPU); never install torch_tpu on a host "
        "without TPUs: it loads on every `import torch` and hangs there"
    )
    dist_backend = None  # the backend TorchTPU registers for the "tpu" device type
    compile_backend = "tpu"
    static_shapes = True

    def device_name(self) -> str:
        """The chip generation: ``$PORTATRAIN_TPU_CHIP``, else ``$TPU_ACCELERATOR_TYPE``.

        We query no TorchTPU or metadata-server API for it (unverified here, and a metadata
        request can hang off-cloud). GKE sets ``TPU_ACCELERATOR_TYPE`` (e.g. ``v5litepod-16``) on
        TPU pods, as Ray's TPU support reads it; on a plain TPU VM set ``PORTATRAIN_TPU_CHIP``.
        """
        chip = os.environ.get(TPU_CHIP_ENV) or os.environ.get("TPU_ACCELERATOR_TYPE")
        # The fallback names no generation: it must not match a table row.
        return f"TPU {chip}" if chip else f"TPU of unknown generation (set {TPU_CHIP_ENV})"

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        tflops = lookup_peak_tflops(TPU_PEAK_TFLOPS, self.device_name(), str(dtype).removeprefix("torch."))
        return None if tflops is None else tflops * 1e12
