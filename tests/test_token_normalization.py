"""Token-exact normalization: a step's loss is the sum over every valid token of the global batch
divided by their global count (``Trainer.train_step``: the count is all-reduced before any backward,
each micro-batch backpropagates ``loss_sum / global_count``; FSDP2 sums gradients, divide factor 1).

Each case below holds different valid-token counts across its micro-batches or ranks -- right-padded
rows (``data.collator=pad_to_max``) of documents of different lengths -- and is compared with one
process on the same global batch. A mean taken per micro-batch, per rank or per context-parallel shard
(then averaged) weighs the tokens of a short part more, and differs; the count checks make sure each
case is uneven. DPO normalizes by pairs (its loss is a mean of per-pair terms, each a sum over the
pair's valid tokens), so its micro-batches of uneven token counts must match the large batch too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portatrain.dpo_trainer import DPOTrainer
from tests import shared_launch
from tests.helpers import TINY, compose_config, fit, losses, make_trainer
from tests.test_dpo import dpo_overrides, fit_dpo, write_pairs

UNEVEN = [
    "data.collator=pad_to_max",
    "data.seq_len=128",
    "data.sampler=sequential",
    "trainer.steps=3",
    "optim.warmup_steps=0",
    "checkpoint.enabled=false",
]
"""Padded rows in file order: documents shorter than 128 positions leave different amounts of padding."""


def row_counts(overrides: list[str], run_dir: Path, steps: int) -> list[torch.Tensor]:
    """The valid targets of each row of the global batch of each step ``[rows, positions]`` as one
    process reads them (labels != -100)."""
    trainer = make_trainer(overrides, run_dir)
    try:
        batches = iter(trainer.train_loader)
        return [(next(batches)["labels"] != -100) for _ in range(steps)]
    finally:
        trainer.close()


def test_grad_accumulation_with_uneven_micro_batches_matches_the_large_batch(tmp_path: Path) -> None:
    big = [*UNEVEN, "data.batch_size=8", "trainer.grad_accum=1"]
    valid = row_counts(big, tmp_path / "count", 3)
    for rows in valid:  # micro-batch 1 holds rows 0-3, micro-batch 2 rows 4-7
        assert int(rows[:4].sum()) != int(rows[4:].sum())
    want = losses(fit(big, tmp_path / "big").run_dir)
    got = losses(fit([*UNEVEN, "data.batch_size=4", "trainer.grad_accum=2"], tmp_path / "acc").run_dir)
    assert got == pytest.approx(want, rel=1e-6)


def test_dpo_micro_batches_of_uneven_tokens_match_the_large_batch(tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    overrides = dpo_overrides(pairs, "checkpoint.enabled=false", "trainer.steps=2", "data.sampler=sequential")
    accumulated = [*overrides, "data.batch_size=4", "trainer.grad_accum=2"]
    counting = DPOTrainer(compose_config(accumulated, run_dir=tmp_path / "count"))
    try:  # the two micro-batches of a step hold different numbers of response tokens
        batches = iter(counting.train_loader)
        first, second = next(batches), next(batches)
        assert int((first["labels"] != -100).sum()) != int((second["labels"] != -100).sum())
    finally:
        counting.close()
    want = losses(fit_dpo([*overrides, "data.batch_size=8"], tmp_path / "big").run_dir)
    got = losses(fit_dpo(accumulated, tmp_path / "acc").run_dir)
    assert len(want) == 2 and got == pytest.approx(want, rel=1e-6)


def _halves(rows: torch.Tensor) -> tuple[int, int]:
    return int(rows[: len(rows) // 2].sum()), int(rows[len(rows) // 2 :].sum())


def _cp_shards(rows: torch.Tensor) -> tuple[int, int]:
    """Valid targets of the two cp=2 ranks: the row in four chunks, rank 0 the first and last
    (``portatrain.parallel.context``: head and tail chunks, for causal balance)."""
    chunks = [int(c.sum()) for c in rows.chunk(4, dim=1)]
    return chunks[0] + chunks[3], chunks[1] + chunks[2]


uneven_layouts = shared_launch.declare(
    "uneven_layouts",
    2,
    {
        "dp2": [*TINY, *UNEVEN, "data.batch_size=4", "parallel.dp_shard=2"],
        "pp2": [*TINY, *UNEVEN, "data.batch_size=4", "parallel.pp=2", "parallel.pp_microbatches=2"],
        "cp2": [*TINY, *UNEVEN, "data.batch_size=4", "parallel.cp=2"],
    },
)


@pytest.mark.slow
def test_data_pipeline_and_context_parallel_with_uneven_tokens_match_one_process(
    uneven_layouts, tmp_path: Path
) -> None:
    """In the two-process launch: dp_shard=2 (ranks of uneven counts), pp=2 with two micro-batches
    (micro-batches of uneven counts) and cp=2 (shards of uneven counts: padding sits at the rows' ends),
    each against one process on the same global batch."""
    one = {"dp2": [*UNEVEN, "data.batch_size=8"], "pp2": [*UNEVEN, "data.batch_size=4"]}
    one["cp2"] = one["pp2"]
    dp_rows = row_counts(one["dp2"], tmp_path / "count_dp", 3)
    rows = row_counts(one["pp2"], tmp_path / "count", 3)
    for step in range(3):
        a, b = _halves(dp_rows[step].sum(dim=1))  # dp rank r reads rows [4r, 4r + 4) of the global batch
        c, d = _halves(rows[step].sum(dim=1))  # micro-batch m holds rows [2m, 2m + 2)
        e, f = _cp_shards(rows[step])
        assert a != b and c != d and e != f, step
    dirs = uneven_layouts
    for name, overrides in one.items():
        want = losses(fit(overrides, tmp_path / f"one_{name}").run_dir)
        assert losses(dirs[name]) == pytest.approx(want, rel=1e-5), name
