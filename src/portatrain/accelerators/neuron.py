"""AWS Trainium through TorchNeuron (``torch_neuronx``), a native PrivateUse1 device named ``neuron``.

Every TorchNeuron-specific name below was checked against AWS's Neuron documentation
(awsdocs-neuron.readthedocs-hosted.com and its source, github.com/aws-neuron/aws-neuron-sdk);
the page is cited next to it. Not run on Trainium: see the device table in docs/devices.md.

- TorchNeuron is the native backend (not the older XLA-based torch-neuronx) and supports Trn2
  and Trn3 only ("TorchNeuron supports the Trn2 and Trn3 instance families",
  torch/get-started/quickstart-torch-neuron; setup/pytorch/index: torch-neuronx 2.13.x / 2.14.x).
- Code written against ``torch.accelerator`` needs no change
  (frameworks/torch/pytorch-native-overview.rst, FAQ), so the base class's generic calls serve.
- A ``neuron`` device is one *logical* NeuronCore, the unit of distribution: one process per
  logical core (pytorch-native-overview.rst: "the unit of distribution is the NeuronCore";
  64 ranks on a trn2.48xlarge). The index comes from what the process sees (base ``select_index``).
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path

import torch

from portatrain.accelerators.base import Accelerator, lookup_peak_tflops

logger = logging.getLogger(__name__)

NEURON_CHIP_ENV = "PORTATRAIN_NEURON_CHIP"
"""Names the Trainium generation for the peak-FLOPs table: ``trn2`` or ``trn3``."""
SUPPORTED_CHIPS = ("trn2", "trn3")
"""Generations TorchNeuron supports (Trn1 is not one of them)."""
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
"""Neuron runtime setting: physical NeuronCores per logical core, 1 or 2, default 2 on Trn2/Trn3
(about-neuron/arch/neuron-features/logical-neuroncore-config.rst)."""
PHYSICAL_CORES_PER_CHIP = 8
"""Trainium2: eight NeuronCore-v3; Trainium3: eight NeuronCore-v4 (neuron-hardware/trainium2.rst, trainium3.rst)."""

# Dense peak TFLOP/s per CHIP, from AWS's architecture pages (aws-neuron-sdk
# about-neuron/arch/neuron-hardware/trainium2.rst and trainium3.rst; dense, the sparse column is separate):
#   Trainium2: 667 BF16/FP16/TF32, 181 FP32      Trainium3: 671 BF16/FP16/TF32, 183 FP32
# One torch device is one logical NeuronCore = LNC physical cores of the chip's 8, so the
# per-device peak is chip * LNC / 8: a quarter of the chip at the default LNC=2 (4 logical cores
# per chip). Trn3's default LNC is taken to be 2 as on Trn2 (the docs give LNC 1 or 2 for both
# and "two physical cores per logical NeuronCore" for TRN2 and TRN3; not stated as a default for Trn3).
NEURON_CHIP_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("trn2", "trainium2"), {"bfloat16": 667.0, "float16": 667.0, "float32": 181.0}),
    (("trn3", "trainium3"), {"bfloat16": 671.0, "float16": 671.0, "float32": 183.0}),
)

NEURON_PIP_INDEX = "https://pip.repos.neuron.amazonaws.com"
"""AWS's Neuron pip repository, passed as an extra index: every Neuron pip instruction uses it
(e.g. libraries/neuronx-distributed/setup: ``--extra-index-url https://pip.repos.neuron.amazonaws.com``)."""


class NeuronAccelerator(Accelerator):
    name = "neuron"
    device_type = "neuron"  # torch/guides/torch-distributed: torch.device("neuron")
    vendor_module = "torch_neuronx"
    install_hint = (
        "on a Trn2 or Trn3 instance with the AWS Neuron driver (TorchNeuron does not support Trn1), "
        "install TorchNeuron from AWS's Neuron pip repository: "
        f"`pip install 'portatrain[neuron]' --extra-index-url {NEURON_PIP_INDEX}` "
        "(PyPI alone serves only a placeholder torch-neuronx), or use AWS's TorchNeuron DLAMI"
    )
    # torch/guides/torch-distributed: dist.init_process_group(backend="neuron"); gloo for CPU tensors.
    dist_backend = "cpu:gloo,neuron:neuron"
    # frameworks/torch/pytorch-native-overview.rst: "@torch.compile(backend="neuron")".
    compile_backend = "neuron"
    # Unverified: kept from the launch articles (one compiled graph per input shape).
    static_shapes = True

    def compile_cache_env(self, cache_dir: Path) -> dict[str, str]:
        """The NEFF cache in ``cache_dir/neuron``, unless the user set one: ``TORCH_NEURONX_NEFF_CACHE_DIR``
        ("Directory for the NEFF compilation cache", tools/neuron-explorer/environment-variables.rst)
        and ``NEURON_COMPILE_CACHE_URL`` (neuronx-cc's persistent cache, default
        ``/var/tmp/neuron-compile-cache``; about-neuron/arch/neuron-features/neuron-caching.rst).
        Not verified on Trainium: whether TorchNeuron reads them at import (autoloaded with
        ``import torch``) or at compile time; set them in ``launch.env`` to be sure."""
        path = str(Path(cache_dir, "neuron").resolve())
        names = ("TORCH_NEURONX_NEFF_CACHE_DIR", "NEURON_COMPILE_CACHE_URL")
        return {name: path for name in names if name not in os.environ}

    def unavailable_reason(self) -> str | None:
        chip = os.environ.get(NEURON_CHIP_ENV)
        if chip is not None and chip.lower() not in SUPPORTED_CHIPS:
            return (
                f"{NEURON_CHIP_ENV}={chip!r}: TorchNeuron supports {' and '.join(SUPPORTED_CHIPS)} only "
                f"(Trn1 runs the older XLA-based torch-neuronx, which portatrain does not drive); "
                f"set {NEURON_CHIP_ENV} to trn2 or trn3 on such an instance"
            )
        return super().unavailable_reason()

    def memory_stats(self) -> dict[str, int]:
        """Allocator statistics after a synchronize: "The Neuron allocator is asynchronous. Always
        call torch.neuron.synchronize() before you read any memory statistic"
        (torch/guides/memory-profiling-guide, which documents ``torch_neuronx.memory_*``).

        Each ``torch_neuronx`` function is used where present (``memory_allocated`` is on that page;
        ``memory_reserved`` and ``max_memory_allocated`` are assumed to follow the CUDA names), and
        the generic ``torch.accelerator.memory`` one otherwise.
        """
        if not self._is_current_accelerator():
            return {}
        self.synchronize()
        vendor = importlib.import_module(self.vendor_module)
        generic = super().memory_stats()
        stats: dict[str, int] = {}
        for key, fn in (
            ("allocated", "memory_allocated"),
            ("reserved", "memory_reserved"),
            ("peak_allocated", "max_memory_allocated"),
        ):
            documented = getattr(vendor, fn, None)
            try:
                stats[key] = int(documented())  # the current device, set by set_device()
            except (TypeError, RuntimeError):  # absent (None is not callable) or another signature
                if key in generic:
                    stats[key] = generic[key]
        return stats

    def logical_cores_per_chip(self) -> int:
        """Logical NeuronCores (torch devices) per chip: 8 / LNC (4 at the default LNC=2)."""
        raw = os.environ.get(LNC_ENV, "2")
        if raw not in ("1", "2"):
            logger.warning("%s=%r is not 1 or 2 (the only supported values); assuming 2", LNC_ENV, raw)
            raw = "2"
        return PHYSICAL_CORES_PER_CHIP // int(raw)

    def device_name(self) -> str:
        """ "Trainium <chip>, logical NeuronCore (1/4 chip)" from ``$PORTATRAIN_NEURON_CHIP``.

        No TorchNeuron API that names the chip generation was found in the documentation; the
        variable keeps the claim in one visible place. The fallback names no generation, so it
        matches no table row and MFU is simply not reported.
        """
        chip = os.environ.get(NEURON_CHIP_ENV)
        share = f"logical NeuronCore (1/{self.logical_cores_per_chip()} chip)"
        if chip:
            return f"Trainium {chip.lower()}, {share}"
        # No generation in the text: it must match no table row.
        return f"Neuron {share} of unknown generation (set {NEURON_CHIP_ENV})"

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        precision = str(dtype).removeprefix("torch.")
        chip_tflops = lookup_peak_tflops(NEURON_CHIP_PEAK_TFLOPS, self.device_name(), precision)
        if chip_tflops is None:
            return None
        return chip_tflops / self.logical_cores_per_chip() * 1e12

    def low_precision_matmuls(self) -> dict[str, str]:
        """Per AWS's architecture pages: Trainium2's NeuronCore-v3 Tensor Engine runs FP8 (cFP8, whose
        exponent bias is adjustable) at twice its BF16 rate (158 against 79 TFLOPS;
        about-neuron/arch/neuron-hardware/neuron-core-v3.rst); Trainium3's NeuronCore-v4 lists
        MXFP8/MXFP4 (2,517 against 671 BF16 TFLOPS per chip; trainium3.rst) and no plain FP8 figure,
        so FP8 is not declared there. An unknown generation (no ``$PORTATRAIN_NEURON_CHIP``) declares
        nothing. Not run on Trainium: whether TorchNeuron lowers ``torch._scaled_mm`` is untested."""
        chip = os.environ.get(NEURON_CHIP_ENV, "").lower()
        return {"trn2": {"float8": "native"}, "trn3": {"mxfp8": "native"}}.get(chip, {})

    def profiler_activities(self) -> list[torch.profiler.ProfilerActivity]:
        # tools/neuron-explorer/how-to-profile-pytorch: pass ProfilerActivity.CPU and
        # ProfilerActivity.PrivateUse1 ("Both are required for a complete CPU-to-device view").
        activity = torch.profiler.ProfilerActivity
        return [activity.CPU, activity.PrivateUse1]
