"""The loss-spike guard (``trainer.spike_guard``, ``portatrain.train.spike``): a spiking step is not
applied, in lockstep, and the run goes on as if it had never seen that batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from portatrain.train.spike import SpikeGuard
from portatrain.trainer import Trainer
from tests.helpers import fit, read_metrics, step_losses
from tests.test_command_errors import run

SPIKE_STEP = 4
CONSTANT_LR = ["optim.warmup_steps=0", "optim.decay=constant", "trainer.steps=7", "checkpoint.enabled=false"]


class SpikeAt4(Trainer):
    """Step 4's loss (and so its gradients) is 50x what its batch gives: a spike, finite."""

    def compute_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        loss = super().compute_loss(logits, batch)
        return loss * 50.0 if self.step + 1 == SPIKE_STEP else loss


class NeverSeesBatch4(Trainer):
    """The reference: step 4's batch is drawn and dropped before any forward (as fit() drops a step
    fault tolerance did not commit), so the run trains on the batches after it instead (no spike)."""

    dropped = False

    def train_step(self, batches: list[dict]) -> dict:
        if self.step + 1 == SPIKE_STEP and not self.dropped:
            self.dropped = True
            return {"committed": False}
        return super().train_step(batches)


def test_the_window_judges_only_when_full_and_a_skipped_loss_never_enters_it() -> None:
    guard = SpikeGuard(3, 2.0, device=torch.device("cpu"))
    decisions = []
    for loss in [5.0, 1.0, 1.0, 1.0, 4.0, 1.5]:  # 5.0 before the window is full: applied
        loss = torch.tensor(loss)
        ok = guard.check(loss)
        guard.applied(loss, ok)
        decisions.append(bool(ok))
    assert decisions == [True, True, True, True, False, True]  # median of [1, 1, 1] -> 4.0 > 2 x 1
    assert guard.metrics() == {"spike_skipped": 1}
    assert sorted(guard.losses.tolist()) == [1.0, 1.0, 1.5]
    state = guard.state_dict()
    again = SpikeGuard(3, 2.0, device=torch.device("cpu"))
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_a_spike_is_skipped_and_the_run_goes_on_as_if_it_never_saw_the_batch(tmp_path: Path) -> None:
    guarded = fit(
        [*CONSTANT_LR, "trainer.spike_guard.window=3", "trainer.spike_guard.factor=3"],
        tmp_path / "g",
        SpikeAt4,
    )
    reference = fit(CONSTANT_LR, tmp_path / "r", NeverSeesBatch4)
    unguarded = fit(CONSTANT_LR, tmp_path / "u", SpikeAt4)
    g, r, u = step_losses(tmp_path / "g"), step_losses(tmp_path / "r"), step_losses(tmp_path / "u")
    assert g[SPIKE_STEP] > 10 * g[SPIKE_STEP - 1]  # the spike happened and was logged
    # After the skipped step, the guarded run's step s is the reference's step s - 1: same weights, same batch.
    for step in range(SPIKE_STEP + 1, 8):
        assert g[step] == pytest.approx(r[step - 1], rel=1e-6, abs=1e-7), step
    assert any(abs(g[s] - u[s]) > 1e-3 for s in range(SPIKE_STEP + 1, 8))  # without the guard it differs
    assert guarded.step == reference.step == unguarded.step == 7
    logged = [m.get("spike_skipped") for m in read_metrics(tmp_path / "g") if "loss" in m]
    assert logged == [None] * (SPIKE_STEP - 1) + [1] * (8 - SPIKE_STEP)


class SpikeOnce(Trainer):
    """The first time step 4 is trained, its loss is 50x what its batch gives (a rewound run trains a
    step 4 again, on another batch: no spike then)."""

    spiked = False

    def compute_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        loss = super().compute_loss(logits, batch)
        if self.step + 1 == SPIKE_STEP and not self.spiked:
            self.spiked = True
            return loss * 50.0
        return loss


class NeverSeesBatches3And4(Trainer):
    """The reference of a rewind to step 2's checkpoint: the batches of steps 3 and 4 are drawn and
    dropped before any forward, so step 3 trains on the fifth batch."""

    dropped = 0

    def train_step(self, batches: list[dict]) -> dict:
        if self.step == 2 and self.dropped < 2:
            self.dropped += 1
            return {"committed": False}
        return super().train_step(batches)


def test_rewind_goes_back_to_the_checkpoint_and_skips_the_batches_since(tmp_path: Path) -> None:
    saving = [*CONSTANT_LR[:-1], "checkpoint.every=2", "checkpoint.final=false"]
    rewind = [
        "trainer.spike_guard.window=2",
        "trainer.spike_guard.factor=3",
        "trainer.spike_guard.action=rewind",
    ]
    guarded = fit([*saving, *rewind], tmp_path / "g", SpikeOnce)
    fit(saving, tmp_path / "r", NeverSeesBatches3And4)
    records = [m for m in read_metrics(tmp_path / "g") if "loss" in m]
    # Steps 1-3 trained, step 4 spiked (not logged): back to step 2's checkpoint, then steps 3-7 again.
    assert [m["step"] for m in records] == [1, 2, 3, 3, 4, 5, 6, 7]
    assert records[2]["loss"] != records[3]["loss"]  # step 3 again, on the fifth batch
    g, r = step_losses(tmp_path / "g"), step_losses(tmp_path / "r")
    for step in range(1, 8):  # after the rewind: the weights of step 2 and the batches after the spike
        assert g[step] == pytest.approx(r[step], rel=1e-6, abs=1e-7), step
    assert guarded.step == 7 and guarded.optimizer_step.spike_guard.rewinds == 1
    assert [m.get("spike_rewinds") for m in records] == [None] * 3 + [1] * 5


def test_a_spike_before_the_first_checkpoint_is_skipped(tmp_path: Path, caplog) -> None:
    rewind = [
        "trainer.spike_guard.window=3",
        "trainer.spike_guard.factor=3",
        "trainer.spike_guard.action=rewind",
    ]
    overrides = [*CONSTANT_LR[:-1], "trainer.steps=5", "checkpoint.every=5", *rewind]
    with caplog.at_level("WARNING", logger="portatrain.train.step"):
        guarded = fit(overrides, tmp_path / "g", SpikeOnce)
    records = [m for m in read_metrics(tmp_path / "g") if "loss" in m]
    assert [m["step"] for m in records] == [1, 2, 3, 4, 5]  # nothing to go back to: the run goes on
    assert records[SPIKE_STEP - 1]["spike_skipped"] == 1 and "spike_rewinds" not in records[-1]
    assert guarded.optimizer_step.spike_guard.rewinds == 0
    assert any("before the first checkpoint: the step is skipped" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("trainer.spike_guard.window=-1", "trainer.spike_guard.window=-1"),
        ("trainer.spike_guard.factor=0.5", "trainer.spike_guard.factor=0.5"),
        ("trainer.spike_guard.action=restart", "trainer.spike_guard.action='restart'"),
        ("trainer.spike_guard.action=rewind", "trainer.spike_guard.action=rewind goes back"),
    ],
)
def test_bad_spike_guard_settings_are_one_line(override: str, named: str, capsys) -> None:
    overrides = [override] if "window" in override else ["trainer.spike_guard.window=4", override]
    overrides.append("checkpoint.every=0")  # rewind has no checkpoint to go back to
    code, err = run(["trainer.steps=1", *overrides], capsys)
    assert code == 2
    assert named in err and len(err.strip().splitlines()) <= 2, err
