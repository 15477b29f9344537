"""AWS Trainium through TorchNeuron (``torch_neuronx``), a native device named ``neuron``.

As for TPU, the device and compile-backend names are the launch articles' claims, kept in this
one file. The Neuron compiler builds one graph per input shape, hence ``static_shapes``.
"""

from __future__ import annotations

from portatrain.accelerators.base import Accelerator


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
