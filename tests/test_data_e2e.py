"""Done-when of the real-data issue: train the debug recipe from a prepared corpus with a locally
built BPE tokenizer, resume mid-epoch bit-exactly on 1 and on 2 ranks, export, generate with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from portatrain.checkpoint import complete_checkpoints
from portatrain.trainer import Trainer
from tests import shared_launch
from tests.helpers import TINY, compose_config, run_cli, step_losses
from tests.test_tokenizer import make_bpe_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEPS, STOP = 8, 4


def prepare(root: Path) -> None:
    """A BPE tokenizer directory (``tokenizer``) and the bundled corpus prepared with it by ``portatrain
    prepare`` (``corpus``): the two-process launch's setup, or made here when no launch is planned."""
    make_bpe_tokenizer(root / "tokenizer")
    out = run_cli(
        ["prepare", "out=corpus", "data.tokenizer=tokenizer", "data.num_documents=300", "workers=1"], cwd=root
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "prepared 300 documents" in out.stdout


def _run(tokenizer: Path | str, corpus: Path | str, *extra: str) -> list[str]:
    return [*TINY, f"trainer.steps={STEPS}", f"data.dataset={corpus}", f"data.tokenizer={tokenizer}", *extra]


# One two-process launch: the uninterrupted run, then a run stopped after step STOP and its resume in
# the same run directory.
TWO = ["data.batch_size=4", "parallel.dp_shard=2"]
PREPARED = (shared_launch.module_path("tokenizer"), shared_launch.module_path("corpus"))
two_ranks = shared_launch.declare(
    "two_ranks",
    2,
    {
        "ref": _run(*PREPARED, *TWO, "checkpoint.enabled=false"),
        "stopped": [*_run(*PREPARED, *TWO), "run_dir=run"],
        "resumed": [*_run(*PREPARED, *TWO, "checkpoint.resume=auto"), "run_dir=run"],
    },
    stop_at={"stopped": STOP},
    setup=prepare,
)


@pytest.fixture(scope="module")
def prepared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tokenizer and corpus directories: the launch's setup's when the session trains it."""
    launch = request.getfixturevalue("two_ranks")
    if launch.planned:
        root = launch.module_dir
    else:
        root = tmp_path_factory.mktemp("e2e")
        prepare(root)
    return root / "tokenizer", root / "corpus"


class StopAt(Trainer):
    def on_step_end(self, step: int, metrics: dict) -> None:
        if step == STOP and self.dist.is_main:
            self.preemption.requested = True


def _loader_position(run_dir: Path, rank: int = 0) -> dict:
    (ckpt,) = complete_checkpoints(run_dir / "checkpoints")[:1]
    return json.loads((ckpt / f"dataloader_rank{rank}.json").read_text())["stream"]


def test_one_rank_trains_resumes_mid_epoch_exports_and_generates(prepared, tmp_path):
    reference_dir = tmp_path / "reference"
    trainer = Trainer(
        compose_config(_run(*prepared, "data.batch_size=8", "checkpoint.enabled=false"), reference_dir)
    )
    assert trainer.tokenizer.vocab_size == 400 and trainer.data.streaming
    assert trainer.model.embed_tokens.weight.shape[0] == 400  # the embedding follows the tokenizer
    trainer.fit()
    trainer.close()
    reference = step_losses(reference_dir)
    assert sorted(reference) == list(range(1, STEPS + 1)) and reference[STEPS] < reference[1]

    run_dir = tmp_path / "run"
    stopped = StopAt(compose_config(_run(*prepared, "data.batch_size=8"), run_dir))
    stopped.fit()
    stopped.close()
    position = _loader_position(run_dir)
    assert position["epoch"] == 0 and position["batch"] + position["window"] > 0  # mid-epoch
    resumed = Trainer(compose_config(_run(*prepared, "data.batch_size=8", "checkpoint.resume=auto"), run_dir))
    assert resumed.step == STOP
    resumed.fit()
    resumed.close()
    assert step_losses(run_dir) == reference  # bit-exact

    out = tmp_path / "hf"
    export = run_cli(["export", f"run_dir={run_dir}", f"out={out}"], cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-2000:]
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {p.name for p in out.iterdir()}
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    prompt = "Once, Ada walked to the"
    ids = hf_tok(prompt, return_tensors="pt")
    assert ids["input_ids"][0].tolist() == resumed.tokenizer.encode(prompt, eos=False)
    generated = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=hf_tok.pad_token_id)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 8 or hf_tok.eos_token_id in generated[0].tolist()
    assert hf_tok.decode(generated[0], skip_special_tokens=True).startswith(prompt)


def test_two_ranks_resume_mid_epoch_bit_exactly(two_ranks):
    dirs = two_ranks
    reference = step_losses(dirs["ref"])
    assert sorted(reference) == list(range(1, STEPS + 1))

    run_dir = dirs["stopped"]  # its oldest checkpoint is the stop's (step STOP)
    assert _loader_position(run_dir, 0) == _loader_position(run_dir, 1)  # one global position
    assert _loader_position(run_dir)["epoch"] == 0
    assert step_losses(run_dir) == reference  # bit-exact on 2 ranks
