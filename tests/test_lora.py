"""LoRA (``finetune.method=lora``): frozen base, adapters only in the optimizer, PEFT-format export that
``peft.PeftModel`` loads with portatrain's logits, merged export, resume, and the bad-input lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from portatrain.checkpoint import BASE_DIR, complete_checkpoints
from portatrain.export import ADAPTER_DIR, export_hf
from portatrain.finetune.lora import LoRALinear, adapters_disabled, is_adapter_key
from portatrain.trainer import Trainer
from portatrain.validate import config_problems
from tests import shared_launch
from tests.conftest import TINY, compose_config, run_cli
from tests.helpers import train_records
from tests.test_lora_checkpoint import model_keys

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ATOL = 1e-4
# A high, constant learning rate: after 3 steps the adapters are far from zero (B starts at 0), and
# a run stopped early has the learning rates of a longer one.
LORA = [
    *TINY,
    "finetune.method=lora",
    "trainer.steps=3",
    "optim.lr=0.02",
    "optim.warmup_steps=0",
    "optim.decay=constant",
]
SMALL = ["model.n_layers=2", "data.num_documents=60"]
FAMILIES = {
    "llama3": ("model=llama3_debug", "LlamaForCausalLM"),
    "qwen3": ("model=qwen3_debug", "Qwen3ForCausalLM"),
    "olmo2": ("model=olmo2_debug", "Olmo2ForCausalLM"),
    "qwen3_moe": ("model=qwen3_moe_debug", "Qwen3MoeForCausalLM"),
}


def lora_run(tmp_path: Path, overrides: list[str]) -> Trainer:
    """A LoRA run of the small debug model (``overrides`` last), fitted and closed."""
    trainer = Trainer(compose_config([*LORA, *SMALL, *overrides], run_dir=tmp_path / "run"))
    trainer.fit()
    trainer.close()
    return trainer


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_loads_the_exported_adapters_with_matching_logits(family: str, tmp_path: Path) -> None:
    model_override, architecture = FAMILIES[family]
    initial = Trainer(compose_config([*LORA, *SMALL, model_override], run_dir=tmp_path / "init"))
    base_before = {k: v.clone() for k, v in initial.model.state_dict().items() if not is_adapter_key(k)}
    initial.close()
    trainer = lora_run(tmp_path, [model_override])
    model = trainer.model.eval()

    # Only the adapters trained, and only they have optimizer state.
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(n) for n in trainable)
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    for key, value in base_before.items():
        assert torch.equal(model.state_dict()[key], value), key
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} - (
        {"gate_proj", "up_proj", "down_proj"} if family == "qwen3_moe" else set()  # experts: not adapted
    )

    checkpoint = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    out = export_hf(checkpoint, tmp_path / "hf", max_shard_size=10**9)
    merged = export_hf(checkpoint, tmp_path / "merged", max_shard_size=10**9, merge_lora=True)
    config = json.loads((out / ADAPTER_DIR / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and not (merged / ADAPTER_DIR).exists()

    ids = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(0))
    hf_cls = getattr(transformers, architecture)
    base = hf_cls.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(ids)
        with adapters_disabled(model):
            ours_base = model(ids)
        assert (ours_base - base(input_ids=ids).logits).abs().max() <= ATOL
        theirs = peft.PeftModel.from_pretrained(base, out / ADAPTER_DIR).eval()(input_ids=ids).logits
        plain = hf_cls.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits
    assert (ours - ours_base).abs().max() > 100 * ATOL  # the adapters changed the model
    assert (ours - theirs).abs().max() <= ATOL
    assert (ours - plain).abs().max() <= ATOL


def test_lora_bad_input_is_one_line_each(tmp_path: Path) -> None:
    cfg = compose_config([*LORA, "finetune.lora.rank=0", "finetune.lora.targets=[qkv,q_proj]"])
    problems = config_problems(cfg)
    assert any(p.startswith("finetune.lora.rank=0 must be positive") for p in problems)
    [target] = [p for p in problems if "'qkv' matches no linear layer" in p]
    assert "q_proj" in target and "\n" not in target
    moe = compose_config([*LORA, "model=qwen3_moe_debug", "finetune.lora.targets=[experts]"])
    assert any("routed experts are stacked weights" in p for p in config_problems(moe))

    result = run_cli([*LORA, "finetune.lora.rank=-1", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2
    assert "finetune.lora.rank=-1 must be positive" in result.stderr and "Traceback" not in result.stderr


COMMON = [*LORA, *SMALL, "trainer.steps=4", "data.num_documents=200"]
four_processes = shared_launch.declare(
    "four_processes",
    4,
    {
        "dist": [
            *COMMON,
            "trainer.steps=2",
            "data.batch_size=4",
            "parallel.dp_shard=2",
            "parallel.tp=2",
            "parallel.activation_checkpointing=selective",
            "compile.enabled=true",
            "compile.backend=aot_eager",
            "trainer.loss=chunked",
        ]
    },
)


@pytest.mark.slow
def test_lora_fsdp2_x_tp_compiled_checkpointed_chunked_resumes_in_one_process(
    four_processes, tmp_path: Path
) -> None:
    """FSDP2 x TP (4 processes), selective activation checkpointing, compiled blocks and the chunked
    loss train LoRA as one process does (fp32, 1e-5); the checkpoint of step 2 (the adapters; the
    frozen base saved once beside it) resumes in one process."""
    reference = lora_run(tmp_path / "one", ["trainer.steps=4", "data.num_documents=200", "data.batch_size=8"])
    want = train_records(reference.run_dir)
    run_dir = four_processes["dist"]
    # The 4 ranks saved the adapters in the step and the frozen base once, each rank its shards.
    frozen = {n for n, p in reference.model.named_parameters() if not p.requires_grad}
    step, base = complete_checkpoints(run_dir / "checkpoints")[-1], run_dir / "checkpoints" / BASE_DIR
    assert frozen and model_keys(base) == frozen and not model_keys(step) & frozen
    assert len(list(base.glob("*.distcp"))) == 4
    # Same global batch in one process: data.batch_size=8 (checkpoint.resume continues its data order),
    # the base resharded from 4 ranks to one.
    resumed = run_cli(
        [*COMMON, "data.batch_size=8", "checkpoint.resume=auto", f"run_dir={run_dir}"], cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = train_records(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-5), (g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), (g, w)
