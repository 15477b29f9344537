"""``quantize.linear``: FP8 and MXFP8 matmuls through torchao, a model converter (``portatrain.converters``).

On CPU the recipes run emulated (the adapter declares it): torch's CPU ``_scaled_mm`` and torchao's
emulated MXFP8 round to the real 8-bit formats, so the losses below are those of the formats, not of
a stand-in. The training runs share one module fixture: 50 steps of a 2-block Llama (dim 64) on 2 x 32
tokens per step, in bf16 and in each recipe (fp32 elsewhere, the CPU's default); about 12 s of CPU in
all, torchao's import included.

Tolerance of a recipe's step-50 loss against bf16's: 2% relative. Derivation: e4m3 keeps 3 mantissa
bits against bf16's 7, so each cast's relative rounding error is 2^4 = 16 times bf16's; bf16 ends
0.07% from fp32 in this run, 16 x 0.07% = 1.1%, rounded up to 2% (measured: 0.3-0.5%).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from portatrain.accelerators import DeviceUnavailableError
from portatrain.accelerators.cpu import CPUAccelerator
from portatrain.accelerators.cuda import CUDAAccelerator
from portatrain.accelerators.neuron import NEURON_CHIP_ENV, NeuronAccelerator
from portatrain.accelerators.tpu import TPUAccelerator
from portatrain.checkpoint import complete_checkpoints
from portatrain.checkpoint.checkpointer import inspect_checkpoint, load_model_weights
from portatrain.converters import build_converters, converter_problems
from portatrain.converters.quantize import QuantizeError, import_torchao, select_linears
from portatrain.errors import ConfigError
from portatrain.models import build_model
from portatrain.parallel import ParallelDims
from portatrain.trainer import Trainer
from portatrain.validate import validate
from tests.helpers import ROOT, TINY, compose_config, fit, losses, torchrun_command, train_records

HAVE_TORCHAO = __import__("importlib").util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(
    not HAVE_TORCHAO, reason="torchao is not installed (pip install -e '.[dev]')"
)

SMALL = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=128",
    "data.seq_len=32",
    "data.batch_size=2",  # 64 tokens per step: a multiple of MXFP8's 32
    "metrics.peak_tflops=1",  # no CPU peak measurement (seconds in bf16)
]
STEPS = 50
RECIPES = ("float8_tensorwise", "float8_rowwise", "mxfp8")
TOLERANCE = 0.02  # relative, against bf16: see the module docstring


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Trainer, list[str]]]:
    """``name -> (run dir, trainer, the converter's log lines)`` for bf16 and each recipe, 50 steps."""
    if not HAVE_TORCHAO:
        pytest.skip("torchao is not installed")
    out = {}
    common = [*SMALL, f"trainer.steps={STEPS}", f"trainer.log_every={STEPS}", "optim.warmup_steps=5"]
    for name, extra in [
        ("bf16", ["trainer.dtype=bfloat16"]),
        *((r, [f"quantize.linear={r}"]) for r in RECIPES),
    ]:
        handler = _Lines()
        log = logging.getLogger("portatrain.converters.quantize")
        log.addHandler(handler)
        level = log.level
        log.setLevel(logging.INFO)
        run_dir = tmp_path_factory.mktemp(name)
        try:
            trainer = fit([*common, *extra], run_dir)
        finally:
            log.removeHandler(handler)
            log.setLevel(level)
        out[name] = (run_dir, trainer, handler.lines)
    return out


@needs_torchao
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_within_tolerance_of_bf16_and_says_it_is_emulated(runs, recipe: str) -> None:
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    run_dir, trainer, lines = runs[recipe]
    layer = trainer.model.layers["0"].self_attn.q_proj
    assert isinstance(layer, MXFP8Linear if recipe == "mxfp8" else Float8Linear)
    assert type(trainer.model.lm_head) is nn.Linear  # the output head stays in high precision
    assert layer.weight.dtype == torch.float32  # the master weight is untouched
    ours, bf16 = losses(run_dir)[-1], losses(runs["bf16"][0])[-1]
    assert abs(ours - bf16) / bf16 < TOLERANCE, (recipe, ours, bf16)
    # One line: what was converted, what was kept, and that the CPU emulates it.
    (line,) = lines
    assert f"quantize.linear={recipe}: 14 linear layers" in line and "emulated on cpu" in line, line
    assert "lm_head" in line


@needs_torchao
def test_checkpoint_holds_fp32_weights_resumes_with_or_without_fp8_and_exports(runs, tmp_path: Path) -> None:
    """A run trained with FP8 saved its fp32 master weights: it resumes with or without the recipe,
    and ``export`` writes a Hugging Face model that transformers loads with the same logits."""
    transformers = pytest.importorskip("transformers")
    from portatrain.export import export_hf, parse_size

    run_dir, trainer, _ = runs["float8_rowwise"]
    (ckpt,) = complete_checkpoints(run_dir / "checkpoints")
    _, metadata = inspect_checkpoint(ckpt)
    dtypes = {
        k: v.properties.dtype for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")
    }
    assert dtypes["model.layers.0.mlp.up_proj.weight"] == torch.float32 and set(dtypes.values()) == {
        torch.float32
    }

    for recipe in ("none", "float8_rowwise"):
        resumed = fit(
            [*SMALL, f"trainer.steps={STEPS + 1}", f"checkpoint.resume={ckpt}", f"quantize.linear={recipe}"],
            tmp_path / recipe,
        )
        assert resumed.step == STEPS + 1 and torch.isfinite(torch.tensor(losses(tmp_path / recipe)[-1]))

    out = export_hf(ckpt, tmp_path / "hf", max_shard_size=parse_size("5GB"))
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg = compose_config([*TINY, *SMALL])
    with torch.device("meta"):
        plain = build_model(cfg.model, vocab_size=258)
    plain.to_empty(device="cpu")
    plain.init_weights(cfg.model.init_std)  # fills the RoPE tables; the weights come next
    load_model_weights(ckpt, plain)
    ids = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (plain.eval()(ids) - hf(input_ids=ids).logits).abs().max().item() <= 1e-4


def test_problems_name_the_value_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    base = compose_config(TINY)

    def with_(*overrides: str):  # noqa: ANN202 (a DictConfig): composing each costs ~0.4 s
        return OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))

    def problems(*overrides: str) -> list[str]:
        return converter_problems(with_(*overrides))

    with pytest.raises(ConfigError) as bad:
        validate(with_("quantize.linear=fp8"))
    assert str(bad.value).splitlines()[1:] == [
        "  - quantize.linear='fp8' is not one of none, float8_tensorwise, float8_rowwise, mxfp8"
    ]
    assert problems("quantize.linear=none") == []
    (tp,) = problems("quantize.linear=float8_rowwise", "parallel.tp=2", "parallel.dp_shard=1")
    assert "parallel.tp=2" in tp and "set parallel.tp=1" in tp
    (pp,) = problems("quantize.linear=float8_rowwise", "parallel.pp=2", "parallel.dp_shard=1")
    assert "parallel.pp=2" in pp
    (lora,) = problems("quantize.linear=mxfp8", "finetune.method=lora")
    assert "LoRA" in lora and "quantize.linear=none" in lora
    # 4 x 68 = 272 tokens: a multiple of 16 (FP8), not of 32 (MXFP8's blocks)
    assert problems("quantize.linear=float8_tensorwise", "data.seq_len=68") == []
    (tokens,) = problems("quantize.linear=mxfp8", "data.seq_len=68")
    assert "4 x 68 positions = 272 tokens per rank, not a multiple of 32" in tokens
    (skip,) = problems("quantize.linear=mxfp8", "quantize.skip_last_blocks=4")
    assert "keeps all 4 blocks in high precision" in skip
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "torchao" else object())
    (missing,) = problems("quantize.linear=float8_rowwise")
    assert "needs torchao" in missing and "pip install 'portatrain[fp8]'" in missing


def test_missing_torchao_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "torchao", None)  # import torchao -> ImportError
    with pytest.raises(QuantizeError) as missing:
        import_torchao()
    assert "\n" not in str(missing.value) and "pip install 'portatrain[fp8]'" in str(missing.value)


def test_filter_keeps_the_head_the_last_blocks_and_unaligned_layers() -> None:
    cfg = compose_config([*TINY, "model.ffn_dim=200"])  # 200 = 8 x 25: gate/up/down not multiples of 16
    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size=258)
    chosen, kept = select_linears(model, multiple=16, skip_last_blocks=1)
    assert sorted(chosen) == sorted(
        f"layers.{i}.self_attn.{p}_proj" for i in range(3) for p in ("q", "k", "v", "o")
    )
    assert kept["outside the blocks"] == ["lm_head"]
    assert len(kept["in the last 1 block(s)"]) == 7
    assert len(kept["dimensions not multiples of 16"]) == 9


class _NoFP8CPU(CPUAccelerator):
    def low_precision_matmuls(self) -> dict[str, str]:
        return {"float8": "native"}  # like an H100: FP8, no MXFP8


def test_a_device_without_the_format_is_refused_in_one_line() -> None:
    cfg = compose_config([*TINY, "quantize.linear=mxfp8"])
    with pytest.raises(QuantizeError) as refused:
        build_converters(cfg, _NoFP8CPU(), ParallelDims.from_config(cfg.parallel, world_size=1))
    message = str(refused.value)
    assert "\n" not in message
    assert (
        "quantize.linear=mxfp8: device cpu" in message
        and "declares no MXFP8 matmuls (declared: float8)" in message
    )
    assert message.endswith("set quantize.linear=float8_tensorwise or float8_rowwise or none")
    none = compose_config(TINY)
    assert (
        len(build_converters(none, _NoFP8CPU(), ParallelDims.from_config(none.parallel, world_size=1))) == 0
    )


def test_adapters_declare_their_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = CUDAAccelerator()
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, formats in [
        ((8, 0), set()),
        ((8, 9), {"float8"}),
        ((9, 0), {"float8"}),
        ((10, 0), {"float8", "mxfp8"}),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert set(cuda.low_precision_matmuls()) == formats, capability
    tpu = TPUAccelerator()
    for name, formats in [("TPU v7", {"float8"}), ("TPU v6e", set()), ("TPU v5p", set())]:
        monkeypatch.setattr(TPUAccelerator, "device_name", lambda self, n=name: n)
        assert set(tpu.low_precision_matmuls()) == formats, name
    for chip, formats in [("trn2", {"float8"}), ("trn3", {"mxfp8"}), ("", set())]:
        monkeypatch.setenv(NEURON_CHIP_ENV, chip)
        assert set(NeuronAccelerator().low_precision_matmuls()) == formats, chip
    assert CPUAccelerator().low_precision_matmuls() == {"float8": "emulated", "mxfp8": "emulated"}


def test_tpu_without_the_hardware_is_refused_by_the_device_check(tmp_path: Path) -> None:
    with pytest.raises(DeviceUnavailableError, match="device=tpu was requested but cannot be used"):
        Trainer(compose_config([*TINY, "device=tpu", "quantize.linear=float8_tensorwise"], run_dir=tmp_path))


@pytest.mark.slow
@needs_torchao
def test_fsdp2_float8_all_gather_matches_one_process(tmp_path: Path) -> None:
    """dp_shard=2 with FP8 all-gather against one process on the same global batch, same recipe.

    The all-gathered FP8 weights are exactly the single process's (each shard is cast with the global
    scale: with ``quantize.fsdp_float8_all_gather=false`` the run is bit-identical to this one, checked
    when this test was written), but each rank scales its own activations and gradients, over half
    the rows: their FP8 rounding differs from one process's. So step 1's loss, computed from equal
    weights, agrees to 1e-4; later steps drift by the rounding of different scales, measured at up to
    0.3%, held to 1%. The checkpoint the two ranks write resumes in one process without FP8."""
    import subprocess

    steps = 3
    common = [*TINY, "quantize.linear=float8_tensorwise", f"trainer.steps={steps}", "metrics.peak_tflops=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("WORLD_SIZE", None)
    cmd = [*torchrun_command(2), "-m", "portatrain"]
    out = subprocess.run(
        [*cmd, *common, "data.batch_size=4", f"run_dir={tmp_path / 'fsdp'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "FSDP2 all-gathers their weights in FP8" in out.stdout + out.stderr
    fit([*common, "data.batch_size=8", "checkpoint.enabled=false"], tmp_path / "one")
    sharded, one = train_records(tmp_path / "fsdp"), train_records(tmp_path / "one")
    assert [r["step"] for r in sharded] == [r["step"] for r in one] == list(range(1, steps + 1))
    assert sharded[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-4)
    for got, want in zip(sharded, one, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-2), (got, want)
    (ckpt,) = complete_checkpoints(tmp_path / "fsdp" / "checkpoints")
    resumed = fit(
        [f"trainer.steps={steps + 1}", f"checkpoint.resume={ckpt}", "data.batch_size=8"], tmp_path / "resumed"
    )
    assert resumed.step == steps + 1


@needs_torchao
def test_mxfp8_follows_autocast() -> None:
    """Autocast over fp32 weights (one device, ``trainer.dtype=bfloat16``): torchao's MXFP8Linear alone
    would multiply bf16 activations with fp32 weights and fail; the converted layer casts both."""
    from portatrain.converters.quantize import MXFP8Linears

    cfg = compose_config([*TINY, *SMALL])
    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size=258)
    MXFP8Linears(skip_last_blocks=0, emulated_on="cpu").convert(model)
    model.to_empty(device="cpu")
    model.init_weights(cfg.model.init_std)
    ids = torch.randint(0, 258, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    logits.float().square().mean().backward()
    grad = model.layers["0"].mlp.down_proj.weight.grad
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0
