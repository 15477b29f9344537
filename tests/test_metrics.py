"""Training metrics: FLOPs and MFU arithmetic, peak tables, sinks, profiler, and no extra syncs."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from portatrain.accelerators.cpu import PEAK_CACHE_ENV, CPUAccelerator, measured_peak
from portatrain.accelerators.cuda import CUDAAccelerator
from portatrain.metrics import (
    above_peak,
    memory_high_water,
    model_flops,
    resolve_peak_flops,
    throughput_metrics,
)
from portatrain.models.llama.model import LLAMA3_FLAVORS
from portatrain.trainer import Trainer
from tests.conftest import TINY, compose_config
from tests.helpers import CountingCPU, read_metrics

TRAIN_FIELDS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens_seen",
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "memory_peak_bytes",
}


# -- FLOPs and MFU arithmetic --------------------------------------------------------------------
def test_flops_per_token_matches_a_hand_count() -> None:
    """6 x matmul params + 12 x layers x heads x head_dim x seq (PaLM), written out for two flavours."""
    # debug: dim 128, 4 layers, 4 heads of 32, 2 kv heads, vocab 258, SwiGLU width 384 (2/3 * 512 -> 64s).
    block = (128 * 128 * 2 + 128 * 64 * 2) + 3 * 128 * 384 + 2 * 128  # q,o + k,v; MLP; 2 norms
    matmul_params = 4 * block + 128 + 258 * 128  # + final norm + untied output projection
    assert matmul_params == 820_608
    assert LLAMA3_FLAVORS["debug"].flops_per_token(256) == 6 * 820_608 + 12 * 4 * 4 * 32 * 256
    # 8B at 8k: 8,030,261,248 params minus the 128256 x 4096 embedding; 32 layers x 32 heads x 128.
    expected_8b = 6 * (8_030_261_248 - 128_256 * 4096) + 12 * 32 * 32 * 128 * 8192
    assert LLAMA3_FLAVORS["8b"].flops_per_token(8192) == expected_8b == 57_914_449_920


def test_model_flops_counts_real_tokens_at_each_batch_length() -> None:
    def fpt(seq_len: int) -> int:
        return 1000 + seq_len

    full = {"labels": torch.ones(2, 8, dtype=torch.long)}
    padded = {"labels": torch.tensor([[1, 2, -100, -100], [3, -100, -100, -100]])}
    assert model_flops([full, padded], fpt) == 16 * 1008 + 3 * 1004
    assert model_flops([full], None) == 0


def test_throughput_and_mfu_arithmetic() -> None:
    # 4 devices, 2 s for 10 steps, 1e6 tokens at 6e9 FLOPs each = 6e15 FLOPs: 7.5e14 FLOP/s per device.
    m = throughput_metrics(
        tokens=1_000_000, flops=6e15, elapsed_s=2.0, steps=10, num_devices=4, peak_flops=989.5e12
    )
    assert m["step_time_s"] == pytest.approx(0.2)
    assert m["tokens_per_s"] == pytest.approx(500_000)
    assert m["tokens_per_s_per_device"] == pytest.approx(125_000)
    assert m["tflops_per_device"] == pytest.approx(750.0)
    assert m["mfu"] == pytest.approx(750 / 989.5)
    assert (
        throughput_metrics(tokens=1, flops=1, elapsed_s=1, steps=1, num_devices=1, peak_flops=None)["mfu"]
        is None
    )


def test_memory_high_water_prefers_the_allocator_peak() -> None:
    assert memory_high_water({"allocated": 1, "peak_allocated": 5, "reserved": 9}) == 5
    assert memory_high_water({"rss": 3, "peak_rss": 7}) == 7
    assert memory_high_water({}) is None


# -- peak tables ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5),  # SXM
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5),
        ("NVIDIA H100 NVL", torch.bfloat16, 835.5),
        ("NVIDIA H200", torch.bfloat16, 989.5),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
        ("NVIDIA A100 80GB PCIe", torch.float16, 312.0),
        ("NVIDIA H100 80GB HBM3", torch.float32, 67.0),  # no TF32: the plain fp32 rate
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, None),
    ],
)
def test_cuda_peak_by_device_name(monkeypatch, name: str, dtype: torch.dtype, tflops: float | None) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    peak = CUDAAccelerator(0).peak_flops(dtype)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_cuda_fp32_peak_is_tf32_when_tf32_is_enabled(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-40GB")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert CUDAAccelerator(0).peak_flops(torch.float32) == pytest.approx(156e12)


# The TPU and Neuron peak tables are tested with their adapters (tests/test_accelerators.py).


@pytest.fixture
def peak_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty peak cache file, and no measurement remembered by this process."""
    monkeypatch.setenv(PEAK_CACHE_ENV, str(tmp_path / "peaks.json"))
    measured_peak.cache_clear()
    yield tmp_path / "peaks.json"
    measured_peak.cache_clear()


def test_cpu_peak_is_measured_once_per_machine_and_cached_with_its_provenance(
    peak_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = CPUAccelerator(0)
    first = cpu.peak_flops(torch.float32)
    assert first is not None and 1e8 < first < 1e14  # between 0.1 GFLOP/s and 100 TFLOP/s
    (entry,) = json.loads(peak_cache.read_text()).values()
    assert entry["flops"] == first and entry["dtype"] == "float32"
    assert entry["threads"] == torch.get_num_threads() and entry["cpu"] == CPUAccelerator.model_name()
    assert entry["kernels"] == torch.backends.cpu.get_cpu_capability() and entry["measured_at"]
    _, source = resolve_peak_flops(cpu, torch.float32)
    assert source.endswith(f"cached in {peak_cache}") and "measured matmul" in source

    # A later process on a quiet machine reads it back: nothing is timed again, ever.
    entry["quiet"] = True
    peak_cache.write_text(json.dumps({key: entry for key in json.loads(peak_cache.read_text())}))
    measured_peak.cache_clear()
    monkeypatch.setattr("portatrain.accelerators.cpu.measured_matmul_flops", lambda *a, **k: 1 / 0)
    assert CPUAccelerator(0).peak_flops(torch.float32) == first
    peak, source = resolve_peak_flops(cpu, torch.float32, override_tflops=2.5)
    assert peak == pytest.approx(2.5e12) and "metrics.peak_tflops" in source


def test_a_busy_measurement_is_taken_again_at_start_up_and_only_raised(
    peak_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timings = iter([3e9, 2e9, 5e9])  # what three start-ups time, the machine busy for the first two
    monkeypatch.setattr("portatrain.accelerators.cpu.measured_matmul_flops", lambda *a, **k: next(timings))
    monkeypatch.setattr("os.getloadavg", lambda: (9.0, 9.0, 9.0))
    seen = []
    for _ in range(2):
        measured_peak.cache_clear()
        seen.append(measured_peak(torch.float32, 1))
    assert [m.flops for m in seen] == [3e9, 3e9] and not seen[-1].quiet  # the best figure stays
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    measured_peak.cache_clear()
    quiet = measured_peak(torch.float32, 1)
    assert quiet.flops == 5e9 and quiet.quiet and quiet.load == 0.0
    measured_peak.cache_clear()
    assert measured_peak(torch.float32, 1) == quiet  # final: read back, not timed (timings is empty)


# -- the Trainer's records -----------------------------------------------------------------------
def test_jsonl_records_have_the_fields_and_count_real_tokens(tmp_path: Path) -> None:
    """Padded batches (pad_to_max): tokens are label positions, FLOPs follow; syncs only at log steps."""
    seen: list[dict] = []

    class Recording(Trainer):
        def on_step_end(self, step: int, metrics: dict) -> None:
            seen.append({"tokens": metrics["tokens"], "flops": metrics["flops"]})

    accelerator = CountingCPU()
    cfg = compose_config(TINY + ["data.collator=pad_to_max", "trainer.log_every=2"], run_dir=tmp_path)
    trainer = Recording(cfg, accelerator=accelerator)
    trainer.fit()
    trainer.close()

    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        assert record.keys() >= TRAIN_FIELDS
        assert record["mfu"] > 0 and record["memory_peak_bytes"] > 0 and record["step_time_s"] > 0
        assert record["tokens_per_s"] == pytest.approx(record["tokens_per_s_per_device"])
    # Real tokens, not padding: fewer than batch x seq_len positions, and what the log counted.
    positions = 4 * 64
    assert all(0 < s["tokens"] <= positions for s in seen)
    assert sum(s["tokens"] for s in seen) < 4 * positions
    assert records[-1]["tokens_seen"] == sum(s["tokens"] for s in seen)
    fpt = LLAMA3_FLAVORS["debug"].flops_per_token(64)
    assert [s["flops"] for s in seen] == [s["tokens"] * fpt for s in seen]
    # MFU is the window's FLOPs over its time and the peak; the window is 2 steps.
    window = sum(s["flops"] for s in seen[2:])
    expected_mfu = window / (2 * records[-1]["step_time_s"]) / trainer.peak_flops
    assert records[-1]["mfu"] == pytest.approx(expected_mfu, rel=1e-6)
    # No host sync, no memory read on the steps between logs.
    assert accelerator.syncs == 2 and accelerator.memory_reads == 2


def test_tensorboard_event_file_has_the_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = Trainer(compose_config(TINY + ["metrics.tensorboard=true"], run_dir=tmp_path))
    trainer.fit()
    trainer.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/mfu", "train/tokens_per_s", "memory/memory_peak_bytes"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]


def test_no_tensorboard_dir_unless_enabled(tmp_path: Path) -> None:
    trainer = Trainer(compose_config(TINY + ["trainer.steps=1"], run_dir=tmp_path))
    trainer.fit()
    trainer.close()
    assert not (tmp_path / "tensorboard").exists()
    assert not (tmp_path / "profile").exists()


def test_profiler_writes_a_trace_of_the_window(tmp_path: Path) -> None:
    overrides = ["profile.enabled=true", "profile.start_step=2", "profile.steps=2", "trainer.steps=5"]
    trainer = Trainer(compose_config(TINY + overrides, run_dir=tmp_path))
    trainer.fit()
    trainer.close()
    traces = list((tmp_path / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert len(steps) == 2  # exactly the two steps of the window
    assert any("aten::mm" in e.get("name", "") or "aten::addmm" in e.get("name", "") for e in events)


def test_profile_window_must_be_positive(tmp_path: Path) -> None:
    from portatrain.errors import ConfigError

    trainer = Trainer(compose_config(TINY + ["profile.enabled=true", "profile.steps=0"], run_dir=tmp_path))
    try:
        with pytest.raises(ConfigError, match=r"profile.steps=0"):
            trainer.fit()
    finally:
        trainer.close()


def test_a_window_above_the_peak_leaves_the_peak_as_it_is_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A peak below what training reaches (a CPU measurement the machine's load slowed, a low
    ``metrics.peak_tflops``): MFU keeps one denominator for the whole run, so it reads above 100%
    rather than changing its meaning mid-run; one INFO line says why, and nothing is measured again."""
    asked: list[str] = []

    class BusyCPU(CPUAccelerator):
        def peak_flops(self, dtype: torch.dtype) -> float:
            asked.append(str(dtype))
            return 1e3  # what a measurement on a loaded machine might have found: 1 kFLOP/s

    cfg = compose_config(TINY, run_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="portatrain"):
        trainer = Trainer(cfg, accelerator=BusyCPU())
        trainer.fit()
        trainer.close()
    records = read_metrics(tmp_path)
    assert asked == ["torch.float32"] and trainer.peak_flops == 1e3  # once, at start-up, never moved
    assert [r["mfu"] for r in records] == pytest.approx(
        [r["tflops_per_device"] * 1e12 / 1e3 for r in records]
    )
    assert all(r["mfu"] > 1 for r in records)
    notes = [r for r in caplog.records if r.getMessage().startswith("MFU reads above 100%")]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO, [r.getMessage() for r in notes]
    assert "above the peak of 1e-09 TFLOP/s" in notes[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_above_peak_is_silent_at_or_below_the_peak() -> None:
    assert above_peak(2e9, "x", flops=4e9, elapsed_s=1.0, num_devices=2) is None
    assert above_peak(None, "unknown", flops=4e9, elapsed_s=1.0, num_devices=2) is None
    note = above_peak(1e9, "cpu, float32, measured matmul", flops=6e9, elapsed_s=1.0, num_devices=2)
    assert note is not None and "ran at 0.003 TFLOP/s per device, above the peak of 0.001" in note


def test_lora_flops_per_token_is_what_a_step_executes(tmp_path: Path) -> None:
    """torch's FLOP counter over one forward and backward of a LoRA model: the frozen base runs its
    forward and its inputs' gradients but no weight gradient (4 N, not full fine-tuning's 6 N); the
    adapters train (6 per parameter). Within 5%: the counter sees what the formula leaves out --
    the first block's inputs (the frozen embedding's output) need no gradient, and the norms' few
    parameters do no matmul -- 3.9% of it at this 2-layer size."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = compose_config([*TINY, "model.n_layers=2", "finetune.method=lora"], run_dir=tmp_path)
    trainer = Trainer(cfg)
    try:
        tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as counter:
            trainer.model(tokens).sum().backward()
        matmuls = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
        args = dataclasses.replace(LLAMA3_FLAVORS["debug"], n_layers=2)
        attention = args.flops_per_token(64) - args.flops_per_token(0)  # SDPA: not in the counter
        adapters = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        expected = 4 * args.flops_per_token(0) // 6 + 6 * adapters
        assert trainer.flops_per_token(64) - attention == expected
        assert matmuls / tokens.numel() == pytest.approx(expected, rel=0.05)
    finally:
        trainer.close()
