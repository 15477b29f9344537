"""AWS Trainium through TorchNeuron (``torch_neuronx``), a native device named ``neuron``.

As for TPU, the device and compile-backend names are the launch articles' claims, kept in this
one file. The Neuron compiler builds one graph per input shape, hence ``static_shapes``.
"""

from __future__ import annotations

import os

import torch

from portatrain.accelerators.base import Accelerator, lookup_peak_tflops

NEURON_CHIP_ENV = "PORTATRAIN_NEURON_CHIP"
"""Names the Trainium generation for the peak-FLOPs table (``trn1``, ``trn2``)."""

# Dense peak TFLOP/s per Trainium chip, from the AWS Neuron architecture pages
# (awsdocs-neuron.readthedocs-hosted.com, about-neuron/arch/neuron-hardware/trainium and trainium2):
#   Trainium (trn1, 2 NeuronCore-v2):  190 FP16/BF16/cFP8/TF32 TFLOPS, 47.5 FP32 TFLOPS
#   Trainium2 (trn2, 8 NeuronCore-v3): 667 BF16/FP16/TF32 TFLOPS (2,563 sparse), 181 FP32 TFLOPS
# These are per chip. Unverified: how many chips (or NeuronCores) one TorchNeuron "neuron" device
# spans. If a device is one NeuronCore (2 per trn1 chip; 4 logical per trn2 chip at the default
# LNC=2), divide accordingly through metrics.peak_tflops.
NEURON_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("trn2", "trainium2"), {"bfloat16": 667.0, "float16": 667.0, "float32": 181.0}),
    (("trn1", "trainium1"), {"bfloat16": 190.0, "float16": 190.0, "float32": 47.5}),
)


class NeuronAccelerator(Accelerator):
    name = "neuron"
    device_type = "neuron"
    vendor_module = "torch_neuronx"
    install_hint = (
        "on a Trainium instance (trn1/trn2) with the AWS Neuron driver, install the Neuron PyTorch stack "
        "from AWS's Neuron pip repository: `pip install 'portatrain[neuron]'` (PyPI's torch-neuronx is a placeholder)"
    )
    dist_backend = None  # the backend TorchNeuron registers for the "neuron" device type
    compile_backend = "neuron"
    static_shapes = True

    def device_name(self) -> str:
        """The chip generation from ``$PORTATRAIN_NEURON_CHIP`` (``trn1``/``trn2``).

        No torch_neuronx API is queried for it: none is verified here, and the variable keeps the
        claim in one visible place.
        """
        chip = os.environ.get(NEURON_CHIP_ENV)
        # The fallback names no generation: it must not match a table row.
        return f"Trainium {chip}" if chip else f"Neuron device of unknown generation (set {NEURON_CHIP_ENV})"

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        precision = str(dtype).removeprefix("torch.")
        tflops = lookup_peak_tflops(NEURON_PEAK_TFLOPS, self.device_name(), precision)
        return None if tflops is None else tflops * 1e12
