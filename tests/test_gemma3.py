"""Gemma 3: what is its own beyond the conformance suite (``tests/test_conformance.py`` runs parity
with transformers' ``Gemma3ForCausalLM``, export/``init_from``, bf16, FSDP2, the memory estimate and
the published counts for it).

* The published counts against the technical report's non-embedding parameters.
* The sliding-window band: its edges, the packing mask and-ed in, no band for rows within the window.
* Local layers read the window and the local RoPE base, global ones neither (against the model with
  the layer kinds swapped).
* Tensor parallel and pipeline parallel on two processes equal to one process (slow).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from portatrain.models.common.masks import sliding_window_mask, window_mask
from portatrain.models.gemma3.model import GEMMA3_FLAVORS, Gemma3
from tests import shared_launch
from tests.helpers import TINY, fit, train_records

GEMMA = [*TINY, "model=gemma3_debug", "checkpoint.enabled=false", "trainer.steps=3"]
# Untied (a tied head under a pipeline, the last stage holding a copy, is tests/test_pipeline.py's).
UNTIED = [*GEMMA, "model.tie_embeddings=false"]
two_processes = shared_launch.declare(
    "two_processes",
    2,
    {"tp2": [*UNTIED, "parallel.tp=2"], "pp2": [*UNTIED, "parallel.pp=2", "parallel.pp_microbatches=2"]},
)


def test_non_embedding_counts_are_the_reports() -> None:
    """Gemma 3 technical report (https://arxiv.org/abs/2503.19786), table 1, in millions."""
    report = {"1b": 698, "4b": 3_209, "12b": 10_759, "27b": 25_600}
    for flavor, millions in report.items():
        assert round(GEMMA3_FLAVORS[flavor].num_params(exclude_embedding=True) / 1e6) == millions, flavor


def test_the_window_keeps_the_last_keys_and_the_packing_mask() -> None:
    band = window_mask(6, 3)
    for i in range(6):
        assert band[i].nonzero().flatten().tolist() == list(range(max(0, i - 2), i + 1)), i
    assert sliding_window_mask(None, 3, 3) is None  # within the window: plain causal attention
    documents = torch.tensor([0, 0, 0, 0, 1, 1])
    packed = (documents[:, None] == documents[None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    both = sliding_window_mask(packed.expand(2, 1, 6, 6), 6, 3)
    assert torch.equal(both, (packed & band).expand(2, 1, 6, 6))


def test_local_layers_use_the_window_and_their_rope_base() -> None:
    """Rows longer than the window: swapping which layers are local changes the logits, and with no
    layer local (a pattern of 1: every layer global) neither the window nor the local base matters."""
    args = dataclasses.replace(GEMMA3_FLAVORS["debug"], n_layers=2)
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (1, 40))
    reference = Gemma3(args).eval()
    reference.init_weights()

    def logits(**changes):
        model = Gemma3(dataclasses.replace(args, **changes)).eval()
        model.load_state_dict(reference.state_dict())
        with torch.no_grad():
            return model(tokens)

    base = logits()
    assert not torch.allclose(base, logits(sliding_window=32), atol=1e-4)  # layer 0 is local
    assert not torch.allclose(base, logits(rope_local_theta=20_000.0), atol=1e-4)
    all_global = logits(sliding_window_pattern=1)
    torch.testing.assert_close(
        all_global, logits(sliding_window_pattern=1, sliding_window=32, rope_local_theta=20_000.0)
    )


@pytest.mark.slow
def test_tp2_and_pp2_on_two_processes_match_one(two_processes, tmp_path: Path) -> None:
    """The debug model (4 blocks alternating local and global, 64-token rows past its 16-token
    window), untied: tensor parallel (sequence-parallel norms on both sides of each sub-layer,
    per-head q/k norms) and a two-stage pipeline give one process's losses and gradient norms."""
    fit(UNTIED, tmp_path / "one")
    dirs = two_processes
    want = train_records(tmp_path / "one")
    for name, run_dir in dirs.items():
        got = train_records(run_dir)
        assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3], name
        for g, w in zip(got, want, strict=True):
            assert g["loss"] == pytest.approx(w["loss"], abs=1e-5), (name, g, w)
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), (name, g, w)
