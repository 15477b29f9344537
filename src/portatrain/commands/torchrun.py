"""``portatrain torchrun [torchrun args] -m portatrain ...``: torchrun that exits 0 after a stop signal
its workers saved cleanly (``portatrain.launch.elastic``). An argument command: no Hydra config."""

from __future__ import annotations

HYDRA = False
EXAMPLE = "portatrain torchrun --standalone --nproc-per-node=2 -m portatrain trainer.steps=20"


def main(argv: list[str]) -> int:
    from portatrain.launch.elastic import run_torchrun

    return run_torchrun(argv)
