"""Resume on another number of ranks: DCP reshards model and optimizer, the data order carries over.

A run stopped at step 4 on 2 FSDP2 ranks (``data.batch_size=4``) resumes on 1 rank
(``data.batch_size=8``), and the other way round. The global batch (8 rows) is the same, so the
sampler continues the same global batches, and every step's loss matches one uninterrupted
process to fp32 reduction-order rounding. Both runs start from the same Hugging Face directory
(``model.init_from``), which also checks that FSDP2 ranks load their own slices of it. The
two-process runs of both directions train in the session's two-process launch
(``tests/shared_launch.py``), after its setup has saved the weights and stopped the one-process run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from portatrain.checkpoint import CheckpointError, complete_checkpoints, read_trainer_state
from portatrain.trainer import Trainer
from tests import shared_launch
from tests.conftest import TINY, compose_config
from tests.helpers import step_losses

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS, STOP = 8, 4
RUN = [*TINY, f"trainer.steps={STEPS}"]


class StopAt(Trainer):
    """Rank 0 alone asks to stop after step ``STOP``; the ranks agree on it, save, and exit 0."""

    def on_step_end(self, step: int, metrics: dict) -> None:
        if step == STOP and self.dist.is_main:
            self.preemption.requested = True


def stop_one_rank(module_dir: Path) -> None:
    """The launch's setup (a fresh process): random debug-size Llama weights saved by transformers,
    sharded (``hf``), and one process that starts from them and saves at step ``STOP`` (``one_rank``)."""
    from portatrain.models.llama.hf import hf_config
    from portatrain.models.llama.model import LLAMA3_FLAVORS

    config = transformers.LlamaConfig(**hf_config(LLAMA3_FLAVORS["debug"], torch_dtype="float32"))
    transformers.LlamaForCausalLM(config).save_pretrained(module_dir / "hf", max_shard_size="300KB")
    one_rank = module_dir / "one_rank"
    trainer = StopAt(
        compose_config([*RUN, "data.batch_size=8", f"model.init_from={module_dir / 'hf'}"], one_rank)
    )
    trainer.fit()
    trainer.close()
    assert [p.name for p in complete_checkpoints(one_rank / "checkpoints")] == [f"step_{STOP:07d}"]


TWO = [*RUN, "data.batch_size=4", "parallel.dp_shard=2"]
# Two FSDP2 ranks that stop and save at step STOP (two_ranks), and one_rank resumed on them.
runs = shared_launch.declare(
    "runs",
    2,
    {
        # The stop's save is asynchronous (FSDP2 shards staged, committed on a gloo group of its own):
        # the run waits for it before ending.
        "two_ranks": [
            *TWO,
            "checkpoint.async_mode=thread",
            f"model.init_from={shared_launch.module_path('hf')}",
        ],
        # Its final save through DCP's checkpoint process, one per rank.
        "one_to_two": [*TWO, "checkpoint.resume=auto", "checkpoint.async_mode=process", "run_dir=one_rank"],
    },
    stop_at={"two_ranks": STOP},
    setup=stop_one_rank,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, runs) -> dict[int, float]:
    """One uninterrupted process from the setup's weights."""
    run_dir = tmp_path_factory.mktemp("reference")
    hf_dir = runs.module_dir / "hf"  # waits for the setup only
    trainer = Trainer(
        compose_config(
            [*RUN, "data.batch_size=8", "checkpoint.enabled=false", f"model.init_from={hf_dir}"], run_dir
        )
    )
    trainer.fit()
    trainer.close()
    return step_losses(run_dir)


def _assert_close(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-5), step


def test_two_fsdp2_ranks_save_one_rank_resumes(runs, reference: dict) -> None:
    run_dir = runs["two_ranks"]
    (ckpt,) = complete_checkpoints(run_dir / "checkpoints")
    state = read_trainer_state(ckpt)
    assert state["step"] == STOP and state["world_size"] == 2
    assert {p.name for p in ckpt.glob("dataloader_rank*.json")} == {
        "dataloader_rank0.json",
        "dataloader_rank1.json",
    }

    # A different global batch cannot continue the saved data order: one clear error, with the fixes.
    with pytest.raises(CheckpointError, match="checkpoint.restore_data=false"):
        Trainer(compose_config([*RUN, "data.batch_size=4", "checkpoint.resume=auto"], run_dir))
    fresh_order = [*RUN, "data.batch_size=4", "checkpoint.resume=auto", "checkpoint.restore_data=false"]
    Trainer(compose_config(fresh_order, run_dir)).close()  # ... which the suggested fix accepts

    trainer = Trainer(compose_config([*RUN, "data.batch_size=8", "checkpoint.resume=auto"], run_dir))
    assert trainer.step == STOP
    trainer.fit()
    trainer.close()
    _assert_close(step_losses(run_dir), reference)


def test_one_rank_saves_two_fsdp2_ranks_resume(runs, reference: dict) -> None:
    run_dir = runs["one_to_two"]  # saved at STOP by one process (the fixture), resumed by two
    _assert_close(step_losses(run_dir), reference)
    assert read_trainer_state(complete_checkpoints(run_dir / "checkpoints")[-1])["world_size"] == 2
