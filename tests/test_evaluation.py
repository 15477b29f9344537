"""lm-evaluation-harness on portatrain's own model: ``portatrain eval``, ``trainer.eval_tasks``, and the
oracle -- lm-eval's own Hugging Face model (``HFLM``) on the ``portatrain export`` of the same checkpoint.

The tasks are the local ones shipped in ``examples/lm_eval_tasks`` (jsonl data, nothing downloaded);
their ``data_files`` are relative to the repository root, so the tests that load them run there.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from portatrain.checkpoint import complete_checkpoints
from portatrain.evaluation import flat_metrics
from portatrain.export import export_hf
from portatrain.metrics import scalars
from tests.helpers import ROOT, TINY, compose_config, fit, read_metrics, torchrun, train_records
from tests.test_command_errors import one_line_error, run
from tests.test_tokenizer import make_bpe_tokenizer

pytest.importorskip("lm_eval")

TASKS = ROOT / "examples" / "lm_eval_tasks"
INCLUDE = f"eval.include_path=[{TASKS}]"
ATOL = 1e-4


def jsonl(name: str) -> list[dict]:
    return [
        json.loads(line) for line in (TASKS / "portatrain_tiny" / f"{name}.jsonl").read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four steps with a BPE tokenizer directory (``export`` copies it: lm-eval's HF model loads it)."""
    base = tmp_path_factory.mktemp("lmeval")
    tokenizer = make_bpe_tokenizer(base / "tokenizer")
    fit([f"data.tokenizer={tokenizer}"], base / "run")
    return base / "run"


def test_per_sample_scores_match_lm_evals_hf_model_on_the_export(bpe_run: Path, tmp_path: Path) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from portatrain.evaluation.model import harness_lm, load_checkpoint_model

    checkpoint = complete_checkpoints(bpe_run / "checkpoints")[-1]
    theirs = HFLM(
        pretrained=str(export_hf(checkpoint, tmp_path / "hf", max_shard_size=10**9)),
        dtype="float32",
        device="cpu",
        batch_size=3,
        # The export states the context RoPE scaling reaches (transformers warns about anything
        # shorter); the window both score in is the length the model was trained at.
        max_length=512,
    )
    cfg = compose_config(TINY)
    loaded = load_checkpoint_model(cfg, checkpoint)
    ours = harness_lm(
        loaded.model, loaded.tokenizer, cfg.eval, device=loaded.accelerator.device, dtype=loaded.dtype, tp=1
    )
    assert ours.max_length == theirs.max_length == 512

    long_text = " ".join(d["text"] for d in jsonl("perplexity")) * 4  # > 512 tokens: truncation, windows
    pairs = [(d["context"], c) for d in jsonl("choice") for c in d["choices"]]
    pairs += [("", "The quick fox"), (long_text, " near the river.")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    mine, reference = (
        ours.loglikelihood(requests, disable_tqdm=True),
        theirs.loglikelihood(requests, disable_tqdm=True),
    )
    assert max(abs(a[0] - b[0]) for a, b in zip(mine, reference)) <= ATOL
    assert [a[1] for a in mine] == [b[1] for b in reference]

    texts = [d["text"] for d in jsonl("perplexity")] + [long_text]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    mine, reference = ours.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling)
    assert max(abs(a - b) for a, b in zip(mine, reference)) <= ATOL

    settings = {"until": [".", "\n"], "max_gen_toks": 8, "do_sample": False}
    prompts = [d["question"] for d in jsonl("generate")] + ["The red fox sees the"]
    generate = [Instance("generate_until", {}, (p, dict(settings)), i) for i, p in enumerate(prompts)]
    assert ours.generate_until(generate) == theirs.generate_until(generate)


def test_cli_eval_runs_the_local_tasks_and_writes_results(
    bpe_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    out = tmp_path / "results.json"
    argv = ["eval", "device=cpu", f"checkpoint={bpe_run}", "tasks=portatrain_tiny", INCLUDE]
    # In this process, as ``portatrain eval`` runs it (tests.test_command_errors.run).
    status, err = run([*argv, "eval.bootstrap_iters=0", f"out={out}", f"run_dir={tmp_path / 'e'}"], capsys)
    assert status == 0, err[-3000:]
    printed = capsys.readouterr().out
    assert "step_0000004 (step 4)" in printed and "portatrain_tiny_choice" in printed
    results = json.loads(out.read_text())
    assert results["step"] == 4
    assert set(results["results"]) == {f"portatrain_tiny_{t}" for t in ("choice", "generate", "perplexity")}
    assert 0 <= results["results"]["portatrain_tiny_choice"]["acc,none"] <= 1
    assert results["results"]["portatrain_tiny_perplexity"]["byte_perplexity,none"] > 1


@pytest.mark.slow
def test_tasks_during_tensor_parallel_training_match_one_process_eval_of_its_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks, the model's heads and sequence split over them (rows padded to a multiple of 2); only
    rank 0 gets lm-eval's results. The checkpoint then evaluated by one process gives the same numbers."""
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    tasks = ["trainer.eval_tasks=portatrain_tiny", "trainer.eval_tasks_every=2", INCLUDE]
    layout = ["parallel.dp_shard=1", "parallel.tp=2"]
    result = torchrun(2, [*TINY, "trainer.steps=2", *tasks, *layout, f"run_dir={run_dir}"], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    (logged,) = [r for r in read_metrics(run_dir) if "eval/portatrain_tiny_choice/acc" in r]
    shown = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if "eval/portatrain_tiny_choice/acc " in line
    ]
    assert len(shown) == 1, shown  # the evaluation's results on screen once, by rank 0

    out = tmp_path / "one.json"
    args = [
        "eval",
        "device=cpu",
        f"checkpoint={run_dir}",
        "tasks=portatrain_tiny",
        INCLUDE,
        "eval.bootstrap_iters=0",
    ]
    status, err = run([*args, f"out={out}", f"run_dir={tmp_path / 'e'}"], capsys)  # in this process
    assert status == 0, err[-3000:]
    one = flat_metrics(json.loads(out.read_text()))
    assert len(one) == 6 and set(one) <= set(logged)
    for key, value in one.items():
        assert logged[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["tasks=no_such_task_xyz"], ["'no_such_task_xyz'", "lm-eval ls tasks", "eval.include_path"]),
        (
            ["tasks=portatrain_tiny", "checkpoint=/no/such/run/step_0000009"],
            ["/no/such/run/step_0000009", "does not exist"],
        ),
        (["tasks=[]"], ["eval.tasks is empty"]),
        # RULER's task builds its prompts with a Hugging Face tokenizer named in lm-eval's metadata, and
        # its helpers import lm_eval[ruler]'s packages: either is named before the model is loaded.
        (["tasks=niah_single_1"], ["lm-eval task 'niah_single_1'", "choose another task"]),
    ],
)
def test_bad_input_is_one_line(
    args: list[str],
    expected: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    status, err = run(["eval", *TINY, INCLUDE, *args], capsys)
    # A config problem is validate's list ("invalid config:" and one line per problem); others one line.
    problems = [line for line in err.splitlines()[1:] if line.strip()]
    line = (
        problems[0]
        if err.startswith("portatrain eval: error: invalid config:")
        else one_line_error(err, "eval")
    )
    assert status == 2 and "Traceback" not in err and len(problems) <= 1, err
    assert all(text in line for text in expected), line
    assert list(tmp_path.iterdir()) == []  # the run directory Hydra made is gone again


LOCAL_TASK = """
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
"""


def test_tasks_that_cannot_run_here_are_named_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task whose helpers import a missing package (RULER's need lm_eval[ruler]) and one that makes
    its data from lm-eval metadata (custom_dataset: RULER's tokenizer) fail only inside lm-eval's run,
    after the checkpoint's model was built; validation names each, whether asked for by name or group."""
    from portatrain.config import EvalConfig
    from portatrain.evaluation import task_problems

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = TASKS / "portatrain_tiny" / "generate.jsonl"
    (tasks / "helpers.py").write_text("import no_such_package_for_portatrain_tests\n")
    (tasks / "generated.py").write_text(
        "def make(**metadata):\n    raise AssertionError('needs a tokenizer')\n"
    )
    (tasks / "extra.yaml").write_text(
        LOCAL_TASK.format(name="needs_extra", data=data) + "process_results: !function helpers.score\n"
    )
    (tasks / "generated.yaml").write_text(
        LOCAL_TASK.format(name="generated_data", data=data) + "custom_dataset: !function generated.make\n"
    )
    (tasks / "fine.yaml").write_text(LOCAL_TASK.format(name="fine", data=data))
    (tasks / "group.yaml").write_text("group: all_three\ntask: [needs_extra, generated_data, fine]\n")
    cfg = EvalConfig(include_path=[str(tasks)])
    assert task_problems(cfg, ["fine"]) == []
    generated, extra = task_problems(cfg, ["all_three"])  # in task-name order
    assert extra.startswith("lm-eval task 'needs_extra' needs a package that is not installed: ")
    assert "no_such_package_for_portatrain_tests" in extra
    assert generated.startswith("lm-eval task 'generated_data' generates its data from lm-eval metadata")
    assert "--tasks generated_data" in generated

    monkeypatch.chdir(tmp_path)
    status, err = run(["eval", *TINY, f"eval.include_path=[{tasks}]", "tasks=generated_data"], capsys)
    assert status == 2 and "Traceback" not in err, err
    assert [line for line in err.splitlines()[1:] if line.strip()] == [f"  - {generated}"]


def test_training_logs_the_tasks_every_n_steps_without_changing_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    tasks = [
        "trainer.eval_tasks=[portatrain_tiny_choice,portatrain_tiny_generate]",
        "trainer.eval_tasks_every=2",
    ]
    fit([*tasks, INCLUDE, "eval.limit=4"], tmp_path / "with")
    fit([], tmp_path / "without")
    assert [r["loss"] for r in train_records(tmp_path / "with")] == [
        r["loss"] for r in train_records(tmp_path / "without")
    ]  # lm-eval reseeds every random generator; the trainer puts them back
    evals = [r for r in read_metrics(tmp_path / "with") if "eval/portatrain_tiny_choice/acc" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert {"eval/portatrain_tiny_choice/acc_norm", "eval/portatrain_tiny_generate/exact_match"} <= set(
        evals[0]
    )
    assert scalars(evals[0])["eval/portatrain_tiny_choice/acc"] == evals[0]["eval/portatrain_tiny_choice/acc"]


def test_a_lora_checkpoint_loads_with_its_adapters(tmp_path: Path) -> None:
    import torch

    from portatrain.evaluation.model import load_checkpoint_model

    trainer = fit(["finetune.method=lora", "optim.lr=0.05"], tmp_path / "run")
    loaded = load_checkpoint_model(
        compose_config(TINY), complete_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    )
    ids = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, trained = loaded.model(ids), trainer.model.eval()(ids)
        base = loaded.model.layers["0"].self_attn.q_proj
        assert base.lora_B.weight.abs().max() > 0  # trained adapters, not the zero-initialized ones
    assert torch.equal(ours, trained)


def test_datasets_jax_announcement_is_dropped_and_nothing_else(caplog: pytest.LogCaptureFixture) -> None:
    """``datasets`` logs "JAX version X available." at INFO when imported (every evaluation's first
    import of it); the CLI drops that one line, and only that one."""
    from portatrain.cli import _quiet_known_warnings

    _quiet_known_warnings()
    with caplog.at_level(logging.INFO, logger="datasets"):
        logging.getLogger("datasets").info("JAX version 0.10.2 available.")
        logging.getLogger("datasets").info("TensorFlow version 2.20.0 available.")
        logging.getLogger("datasets").warning("JAX version 0.10.2 available, but broken")
    assert [r.getMessage() for r in caplog.records] == [
        "TensorFlow version 2.20.0 available.",
        "JAX version 0.10.2 available, but broken",
    ]


@pytest.mark.parametrize(
    ("rank", "quiet", "level"),
    [(0, False, logging.NOTSET), (0, True, logging.WARNING), (1, False, logging.WARNING)],
)
def test_lm_eval_logs_warnings_only_on_ranks_but_0_and_when_quiet(
    monkeypatch: pytest.MonkeyPatch, rank: int, quiet: bool, level: int
) -> None:
    """Every rank runs the same requests (``portatrain.evaluation.lm``): lm-eval's progress is
    logged by rank 0 alone, and between training steps (``quiet``) by none."""
    import lm_eval

    from portatrain.config import EvalConfig
    from portatrain.evaluation import tasks

    seen = []
    monkeypatch.setattr(
        lm_eval, "simple_evaluate", lambda **kw: seen.append(logging.getLogger("lm_eval").level)
    )
    monkeypatch.setattr(tasks, "task_manager", lambda names, include: None)
    monkeypatch.setattr(tasks.dist, "is_initialized", lambda: rank is not None)
    monkeypatch.setattr(tasks.dist, "get_rank", lambda: rank)
    before = logging.getLogger("lm_eval").level
    tasks.run_tasks(object(), ["t"], EvalConfig(), quiet=quiet)
    assert seen == [level if level != logging.NOTSET else before]
    assert logging.getLogger("lm_eval").level == before  # restored
