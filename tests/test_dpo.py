"""DPO (``finetune.method=dpo``): the loss against its formula, the pairs' rows, training (full and
LoRA) that logs rewards and margins, resume, chat records, FSDP2 parity and the bad-input line."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from portatrain.data.errors import DataError
from portatrain.data.tokenizer import build_tokenizer
from portatrain.dpo_trainer import REFERENCE_FILE, DPOTrainer
from portatrain.finetune.dpo import PairLoader, dpo_loss, encode_pairs, read_pairs, sequence_logps
from tests.conftest import TINY, compose_config, run_cli
from tests.helpers import torchrun, train_records

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


@pytest.mark.slow
def test_dpo_lora_fsdp2_two_processes_match_one(tmp_path: Path) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl")
    overrides = dpo_overrides(pairs, "finetune.dpo.lora=true", "checkpoint.enabled=false")
    fit_dpo([*overrides, "data.batch_size=8"], tmp_path / "one")
    out = torchrun(
        2,
        [*overrides, "data.batch_size=4", "parallel.dp_shard=2", f"run_dir={tmp_path / 'two'}"],
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    want, got = train_records(tmp_path / "one"), train_records(tmp_path / "two")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "dpo/margin", "dpo/rewards_chosen", "dpo/accuracy"):
            assert g[key] == pytest.approx(w[key], abs=1e-5), (key, g, w)
