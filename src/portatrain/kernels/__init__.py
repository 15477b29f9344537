"""Opt-in kernel overrides: a pure-PyTorch reference for each operation, Pallas and NKI kernels.

What is here (see ``kernels/README.md`` at the repository root for how to add a kernel):

* ``reference.py`` -- the PyTorch references models use by default (RMSNorm, SwiGLU, RoPE).
* ``registry.py`` -- :data:`OPERATIONS`, :data:`OVERRIDES` (name -> backend), :func:`config_problems`
  for config validation, :func:`resolve` (once, at model build) and :func:`apply` (swap the model's
  op slots).
* ``custom_ops.py`` -- the ``torch.library`` registration every override goes through (custom op,
  fake, autograd), so ``torch.compile`` sees one op instead of a graph break.
* ``pallas/`` -- Pallas kernels and their bridges (TorchTPU's ``jax_op`` on TPU; interpret mode on CPU).
* ``nki/`` -- NKI kernels and their bridges (``torch_neuronx.nki_op`` on Trainium; ``nki.simulate`` on CPU).
* ``parity.py`` and ``cli.py`` -- parity checks, ``portatrain kernels list|check``.

Importing this package loads torch only: jax, torch_tpu, nki and torch_neuronx are imported by
:func:`resolve` (or by a parity check) for the overrides actually named.
"""

from portatrain.kernels.registry import (
    OPERATIONS,
    OVERRIDES,
    KernelConfigError,
    KernelSet,
    Operation,
    Override,
    apply,
    config_problems,
    resolve,
)

__all__ = [
    "OPERATIONS",
    "OVERRIDES",
    "KernelConfigError",
    "KernelSet",
    "Operation",
    "Override",
    "apply",
    "config_problems",
    "resolve",
]
