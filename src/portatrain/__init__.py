"""portatrain: one PyTorch training codebase for CPU, CUDA, TPU (torch_tpu) and Trainium (torch_neuronx).

Importing the package imports no vendor stack; accelerator adapters load theirs on demand.
"""

__version__ = "0.1.0"
