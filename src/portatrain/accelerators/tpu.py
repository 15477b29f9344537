"""Google TPUs through TorchTPU (``torch_tpu``), a native PrivateUse1 device named ``tpu``.

The names used here (device type ``tpu``, compile backend ``tpu``) come from the launch
articles in ``shared/reference`` and are unverified against a real TPU host; every such call
lives in this file so fixing one is a one-line change. We deliberately use only the generic
``torch.<device_type>`` accessors (``device_count``, ``synchronize``, ``memory_allocated``)
that PrivateUse1 backends register, and fall back to empty statistics when absent.
"""

from __future__ import annotations

from portatrain.accelerators.base import Accelerator


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
