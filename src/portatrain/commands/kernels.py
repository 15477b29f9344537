"""``portatrain kernels list|check``: the kernel overrides, their backends, and parity against the
PyTorch references (``portatrain.kernels``). An argument command: no Hydra config."""

from __future__ import annotations

HYDRA = False

EXAMPLE = "portatrain kernels list"


def main(argv: list[str]) -> int:
    from portatrain.kernels.cli import main as kernels_main

    return kernels_main(argv)
