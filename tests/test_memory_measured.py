"""The dry run's memory estimate held to a measured peak, so neither can drift unnoticed.

One configuration of ``scripts/bench_memory.py`` (the README's table has them all): a Trainer on
CPU in fp32 takes a step, then a second step runs under torch's CPU-allocator accounting
(``measured_peak_bytes``). Measured peak = parameters + optimizer state held before the step + the
step's peak above it; it must lie within 15% of ``estimate_for_config`` (what ``dry_run=true``
prints). Full activation checkpointing and the chunked loss exercise the estimate's two newest
terms (recomputation after the head's buffers are freed; one chunk of logits).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portatrain.models.memory import measured_peak_bytes
from portatrain.plan import estimate_for_config
from tests.helpers import make_trainer

SMALL = [
    "model.dim=256",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.vocab_size=8192",
]
BATCH = ["data.batch_size=4", "data.seq_len=256", "data.collator=pad_to_max", "trainer.dtype=float32"]


def _held_bytes(trainer) -> int:
    tensors = {id(p): p for p in trainer.model.parameters()}
    for state in trainer.optimizer.state.values():
        tensors.update({id(t): t for t in state.values() if isinstance(t, torch.Tensor) and t.numel() > 1})
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize(
    "extra",
    [["parallel.activation_checkpointing=full"], ["trainer.loss=chunked", "trainer.loss_chunk_size=256"]],
    ids=["full-checkpointing", "chunked-loss"],
)
def test_dry_run_estimate_is_within_15_percent_of_the_measured_peak(extra: list[str], tmp_path: Path) -> None:
    trainer = make_trainer([*SMALL, *BATCH, *extra], tmp_path)
    try:
        loader = iter(trainer.train_loader)
        trainer.train_step([next(loader)])  # AdamW's moments now exist
        batch = next(loader)
        held = _held_bytes(trainer)
        measured = held + measured_peak_bytes(lambda: trainer.train_step([batch]))
        estimate = estimate_for_config(trainer.cfg, world_size=1)
    finally:
        trainer.close()
    assert estimate["params"] + estimate["optimizer"] == held  # the persistent state is exact
    ratio = estimate["total"] / measured
    assert 0.85 <= ratio <= 1.15, f"estimate {estimate['total']:,} B vs measured {measured:,} B ({ratio:.3f})"
