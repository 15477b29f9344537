"""DPO (``finetune.method=dpo``): the loss against its formula, the pairs' rows, training (full and
LoRA) that logs rewards and margins, resume, chat records, FSDP2 parity and the bad-input line."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from portatrain.checkpoint import CheckpointError
from portatrain.data.errors import DataError
from portatrain.data.tokenizer import build_tokenizer
from portatrain.dpo_trainer import LEGACY_REFERENCE_FILE, REFERENCE_FILE, DPOTrainer
from portatrain.finetune.dpo import PairLoader, dpo_loss, encode_pairs, read_pairs, sequence_logps
from tests import shared_launch
from tests.conftest import TINY, compose_config, run_cli
from tests.helpers import train_records

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def write_pairs(path: Path, n: int = 48, *, chat: bool = False) -> Path:
    """Pairs whose chosen answer repeats the prompt in capitals and whose rejected one reverses it."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            text = " ".join(rng.choice(WORDS) for _ in range(4))
            if chat:
                prompt = [{"role": "user", "content": text}]
                record = {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": text.upper()}],
                    "rejected": [{"role": "assistant", "content": text[::-1]}],
                }
            else:
                record = {
                    "prompt": f"Q: {text}\nA:",
                    "chosen": " " + text.upper(),
                    "rejected": " " + text[::-1],
                }
            f.write(json.dumps(record) + "\n")
    return path


def dpo_overrides(pairs: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        "model.n_layers=2",
        "finetune.method=dpo",
        f"data.dataset={pairs}",
        "data.seq_len=64",
        "optim.lr=1e-3",
        "optim.warmup_steps=0",
        "optim.decay=constant",
        *extra,
    ]


def fit_dpo(overrides: list[str], run_dir: Path) -> DPOTrainer:
    trainer = DPOTrainer(compose_config(overrides, run_dir=run_dir))
    trainer.fit()
    trainer.close()
    return trainer


def test_dpo_loss_matches_its_formula_on_hand_made_log_probabilities() -> None:
    policy_chosen, policy_rejected = torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -2.0])
    reference_chosen, reference_rejected = torch.tensor([-2.0, -3.0]), torch.tensor([-2.0, -3.0])
    loss, chosen, rejected = dpo_loss(
        policy_chosen, policy_rejected, reference_chosen, reference_rejected, 0.5
    )
    # Pair 0: rewards 0.5 * (-1 + 2) = 0.5 and 0.5 * (-3 + 2) = -0.5: -log sigmoid(1) = log(1 + e^-1).
    # Pair 1: rewards -0.5 and 0.5: -log sigmoid(-1) = log(1 + e).
    assert torch.allclose(chosen, torch.tensor([0.5, -0.5])) and torch.allclose(
        rejected, torch.tensor([-0.5, 0.5])
    )
    assert torch.allclose(loss, torch.tensor([math.log1p(math.exp(-1)), math.log1p(math.e)]))

    # Sequence log-probability: the sum over the target positions of log softmax at the label.
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]]))
    labels = torch.tensor([[0, 1, -100]])
    assert torch.allclose(sequence_logps(logits, labels), torch.tensor([math.log(0.5) + math.log(0.8)]))


def test_pair_rows_mark_only_the_responses(tmp_path: Path) -> None:
    tokenizer = build_tokenizer("byte")
    pairs = encode_pairs(
        tokenizer, read_pairs(str(write_pairs(tmp_path / "p.jsonl", 4)), chat=False), chat=False
    )
    loader = PairLoader(
        pairs, [0, 1, 2], batch_size=2, seq_len=64, pad_id=tokenizer.pad_id, seed=0, train=False
    )
    first, last = list(loader)
    assert first["input_ids"].shape == (4, 64) and last["valid"].tolist() == [1.0, 0.0]
    record = json.loads((tmp_path / "p.jsonl").read_text().splitlines()[0])
    targets = [t for t in first["labels"][0].tolist() if t != -100]
    assert tokenizer.decode(targets[:-1]) == record["chosen"] and targets[-1] == tokenizer.eos_id
    targets = [t for t in first["labels"][2].tolist() if t != -100]
    assert tokenizer.decode(targets[:-1]) == record["rejected"]
    assert (last["labels"][[1, 3]] == -100).all()  # the padding pair has no target
    # A row too short for prompt and response keeps the response (the prompt loses its start), or, for
    # a response longer than the row, the response's beginning.
    for seq_len, want in ((30, record["chosen"]), (12, record["chosen"][:12])):
        short = PairLoader(
            pairs, [0], batch_size=1, seq_len=seq_len, pad_id=tokenizer.pad_id, seed=0, train=False
        )
        targets = [t for t in next(iter(short))["labels"][0].tolist() if t not in (-100, tokenizer.eos_id)]
        assert tokenizer.decode(targets) == want


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_trains_logs_margins_and_resumes(tmp_path: Path, lora: bool) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    # LoRA's few parameters want a larger learning rate.
    lr = "optim.lr=5e-3" if lora else "optim.lr=1e-3"
    overrides = dpo_overrides(pairs, f"finetune.dpo.lora={lora}", "checkpoint.every=2", lr)
    trainer = fit_dpo(overrides, tmp_path / "run")
    records = train_records(tmp_path / "run")
    # Step 1's policy is the reference (LoRA: B = 0, i.e. the base): every reward 0, the loss log 2.
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert records[0]["dpo/margin"] == pytest.approx(0.0, abs=1e-5)
    assert records[-1]["dpo/margin"] > 0.5 and records[-1]["dpo/accuracy"] == 1.0
    assert records[-1]["loss"] < 0.5 * math.log(2)
    assert (tmp_path / "run" / REFERENCE_FILE).is_file() != lora  # LoRA's reference is the base: no file
    if lora:
        assert all(
            n.split(".")[-2] in ("lora_A", "lora_B")
            for g in trainer.optimizer.param_groups
            for n in [
                name for name, p in trainer.model.named_parameters() if any(p is q for q in g["params"])
            ]
        )

    # Resume from step 2 in a copy of the run: steps 3 and 4 are the uninterrupted run's.
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", copy)
    shutil.rmtree(copy / "checkpoints" / "step_0000004")
    (copy / "metrics.jsonl").write_text("")
    fit_dpo([*overrides, "checkpoint.resume=auto"], copy)
    resumed = train_records(copy)
    assert [r["step"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, records[2:], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)


def test_dpo_chat_records(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.test_tokenizer import make_bpe_tokenizer

    tokenizer_dir = make_bpe_tokenizer(tmp_path / "tok")
    pairs = write_pairs(tmp_path / "chat.jsonl", chat=True)
    tokenizer = build_tokenizer(str(tokenizer_dir))
    [(chosen, rejected)] = encode_pairs(tokenizer, read_pairs(str(pairs), chat=True)[:1], chat=True)
    record = json.loads(pairs.read_text().splitlines()[0])
    trained = tokenizer.decode([t for t, m in zip(*chosen) if m])
    assert record["chosen"][0]["content"] in trained and record["prompt"][0]["content"] not in trained
    assert record["rejected"][0]["content"] in tokenizer.decode([t for t, m in zip(*rejected) if m])
    overrides = dpo_overrides(pairs, "data.format=chat", f"data.tokenizer={tokenizer_dir}", "trainer.steps=2")
    fit_dpo(overrides, tmp_path / "run")
    assert train_records(tmp_path / "run")[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_dpo_record_without_rejected_is_one_line(tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", 3)
    lines = pairs.read_text().splitlines()
    lines[1] = json.dumps({"prompt": "Q", "chosen": "A"})
    pairs.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"pairs.jsonl:2: the record has no 'rejected' field"):
        read_pairs(str(pairs), chat=False)
    result = run_cli([*dpo_overrides(pairs), f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if "no 'rejected' field" in line]
    assert "pairs.jsonl:2" in line and '"chosen": "..."' in line


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_dpo_pairs_with_an_empty_response_are_refused(tmp_path: Path, chat: bool) -> None:
    """An empty chosen response scores 0, above any real one: all-empty data trained to accuracy 1.0."""
    from portatrain.validate import config_problems

    pairs = write_pairs(tmp_path / "pairs.jsonl", 6, chat=chat)
    records = [json.loads(line) for line in pairs.read_text().splitlines()]
    for i in (1, 4):
        records[i]["chosen"] = [{"role": "assistant", "content": " "}] if chat else ""
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(DataError) as info:
        read_pairs(str(pairs), chat=chat)
    message = str(info.value)
    assert "2 of 6 records have an empty 'chosen' response (the first at " in message, message
    assert "pairs.jsonl:2" in message and "drop those records" in message
    extra = ["data.format=chat"] if chat else []
    problems = config_problems(compose_config(dpo_overrides(pairs, *extra)))
    assert any("empty 'chosen' response" in p for p in problems), problems


def test_dpo_refuses_the_chunked_loss_pipelines_and_context_parallel(tmp_path: Path) -> None:
    from portatrain.validate import config_problems

    pairs = write_pairs(tmp_path / "pairs.jsonl", 8)
    assert config_problems(compose_config(dpo_overrides(pairs))) == []
    bad = ["trainer.loss=chunked", "parallel.pp=2", "parallel.cp=2", "dry_run=true"]
    problems = config_problems(compose_config(dpo_overrides(pairs, *bad)))
    for start, fix in (
        ("trainer.loss=chunked with finetune.method=dpo", "set trainer.loss=plain"),
        ("parallel.pp=2 with finetune.method=dpo", "set parallel.pp=1"),
        ("parallel.cp=2 with finetune.method=dpo", "set parallel.cp=1"),
    ):
        assert any(p.startswith(start) and fix in p for p in problems), (start, problems)


def _zero_data(path: Path) -> None:
    """Zero a safetensors file's tensor bytes, its header kept (8-byte length, then JSON)."""
    raw = path.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    path.write_bytes(raw[:start] + bytes(len(raw) - start))


def _nan_first(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start : start + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    path.write_bytes(bytes(raw))


def _nan_with_its_checksum(path: Path) -> None:
    """A file whose checksum matches its (non-finite) contents: the finiteness check must catch it."""
    from safetensors.torch import load_file, save_file

    from portatrain.checkpoint.verify import ALGORITHM, checksums

    reference = load_file(str(path))["reference"]
    reference[0, 0] = float("nan")
    checksum = str(checksums({"reference": reference})["reference"])
    save_file({"reference": reference}, str(path), {"checksum_algorithm": ALGORITHM, "checksum": checksum})


def _legacy_pickle(path: Path) -> None:
    torch.save(torch.zeros(48, 2), path.with_name(LEGACY_REFERENCE_FILE))
    path.unlink()


DAMAGE = {
    "zeroed": (_zero_data, "checksum of its log-probabilities does not match"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "is unreadable"),
    "nan": (_nan_first, "checksum of its log-probabilities does not match"),
    "nan_with_checksum": (_nan_with_its_checksum, "holds non-finite (NaN/inf)"),
    "pickle": (lambda p: torch.save(torch.zeros(48, 2), p), "is unreadable"),
    "legacy_pickle": (_legacy_pickle, "earlier portatrain as a pickle"),
}


@pytest.fixture(scope="module")
def full_dpo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Two steps of full DPO, checkpointed at the end: the run a damaged reference is resumed in."""
    base = tmp_path_factory.mktemp("dpo_reference")
    overrides = dpo_overrides(write_pairs(base / "pairs.jsonl"), "trainer.steps=2", "model.n_layers=1")
    fit_dpo(overrides, base / "run")
    return base / "run", [*overrides, "trainer.steps=3", "checkpoint.resume=auto"]


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_dpo_reference_is_refused_naming_the_file(
    full_dpo_run: tuple[Path, list[str]], tmp_path: Path, damage: str
) -> None:
    import shutil

    run_dir, resume = full_dpo_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    reference = copy / REFERENCE_FILE
    config_before = (copy / "config.yaml").read_bytes()
    apply, expected = DAMAGE[damage]
    apply(reference)
    with pytest.raises(CheckpointError) as info:
        DPOTrainer(compose_config(resume, run_dir=copy))
    message = str(info.value)
    assert "\n" not in message and expected in message, message
    assert (LEGACY_REFERENCE_FILE if damage == "legacy_pickle" else REFERENCE_FILE) in message
    assert "start a new run" in message
    assert (copy / "config.yaml").read_bytes() == config_before  # refused before anything is written


def test_a_damaged_dpo_reference_is_one_line_and_exit_2(
    full_dpo_run: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from tests.test_command_errors import one_line_error, run

    run_dir, resume = full_dpo_run
    shutil.copytree(run_dir, tmp_path / "run")
    _zero_data(tmp_path / "run" / REFERENCE_FILE)
    status, err = run([*resume, f"run_dir={tmp_path / 'run'}"], capsys)
    assert status == 2 and REFERENCE_FILE in one_line_error(err, "train")
    # The intact reference resumes (its checksum written at the start matches).
    shutil.copytree(run_dir, tmp_path / "intact")
    assert fit_dpo(resume, tmp_path / "intact").step == 3


def write_launch_pairs(module_dir: Path) -> None:
    """The two-process launch's setup: the pairs (the same as every ``write_pairs`` writes)."""
    write_pairs(module_dir / "pairs.jsonl")


DPO_LORA = ["finetune.dpo.lora=true", "checkpoint.enabled=false"]
two_processes = shared_launch.declare(
    "two_processes",
    2,
    {
        "two": dpo_overrides(
            shared_launch.module_path("pairs.jsonl"), *DPO_LORA, "data.batch_size=4", "parallel.dp_shard=2"
        )
    },
    setup=write_launch_pairs,
)


@pytest.mark.slow
def test_dpo_lora_fsdp2_two_processes_match_one(two_processes, tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    fit_dpo([*dpo_overrides(pairs, *DPO_LORA), "data.batch_size=8"], tmp_path / "one")
    want, got = train_records(tmp_path / "one"), train_records(two_processes["two"])
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "dpo/margin", "dpo/rewards_chosen", "dpo/accuracy"):
            assert g[key] == pytest.approx(w[key], abs=1e-5), (key, g, w)
