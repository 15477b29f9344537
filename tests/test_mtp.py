"""Multi-token prediction (``portatrain.models.common.mtp``; DeepSeek-V3, arXiv:2412.19437 section 2.2):
the loss against one written out depth by depth, the read-ahead targets of packed rows, the Hugging
Face names of the published layer, and FSDP2, context, expert and pipeline parallel against one process
(pipeline parallel in bf16 with tied embeddings too)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from portatrain.losses import ChunkedLoss, chunked_loss_fn
from portatrain.models import model_args
from portatrain.models.deepseek_v3 import DEEPSEEK_V3
from portatrain.models.deepseek_v3 import hf as ds3_hf
from portatrain.models.spec import RuntimeOptions
from portatrain.validate import config_problems
from tests import shared_launch
from tests.helpers import BF16, TINY, bf16_tolerance, compose_config, decoder_roundings, fit, train_records

TINY_ARGS = dict(
    dim=32, n_layers=2, vocab_size=40, max_seq_len=32, n_heads=2, n_kv_heads=2, mtp_loss_weight=0.3
)


def _model(depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    args = dataclasses.replace(DEEPSEEK_V3.flavors["debug"], mtp_layers=depth, **TINY_ARGS)
    model = DEEPSEEK_V3.model_cls(args)
    model.init_weights()
    return model


def _reference_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The paper's equations on unpacked rows of ``S + 1`` tokens (the model reads the first S), depth k
    on the first S-k positions (causal, so cutting the row's tail changes nothing before it):
    h_k = block(eh_proj([enorm(emb(t[i+k])); hnorm(h_{k-1})])), predicting t[i+k+1]."""
    ids, seq_len = tokens[:, :-1], tokens.shape[1] - 1
    captured = {}
    model(ids, output_fn=lambda h, w: captured.setdefault("h", h))  # the main model's normalized output
    h = captured["h"]
    head = model.lm_head.weight
    total = 0.0
    for k, layer in enumerate(model.mtp.layers.values(), start=1):
        n = seq_len - k
        x = layer.eh_proj(torch.cat([layer.enorm(model.embed_tokens(ids[:, k:])), layer.hnorm(h[:, :n])], -1))
        h = layer.block(x, model.rope_cos[:n], model.rope_sin[:n])
        logits = F.linear(layer.norm(h), head)
        total = total + F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1 :].flatten(), reduction="sum")
    return total * model.args.mtp_loss_weight / len(model.mtp.layers)


def test_mtp_loss_equals_the_papers_equations_written_out() -> None:
    model = _model(depth=2)
    hooks = DEEPSEEK_V3.runtime(model, RuntimeOptions("dropless", 1.25, 1.0))
    ids = torch.randint(0, 40, (2, 13))
    batch = hooks.prepare_batch({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    with hooks.extra_loss(batch) as extra:
        logits = model(batch["input_ids"])
    want = _reference_loss(model, ids)
    assert extra.sum.item() == pytest.approx(want.item(), rel=1e-5)
    assert extra.sum.item() > 0
    # The main output is the model's without the depths; evaluation computes no extra loss.
    torch.testing.assert_close(logits, model(batch["input_ids"]))
    model.eval()
    with hooks.extra_loss(batch) as extra:
        model(batch["input_ids"])
    assert extra.sum == 0.0
    # Its own metric: the mean over depths of each depth's mean cross-entropy.
    metrics = hooks.metrics()
    assert 0 < metrics["mtp_loss"] < 2 * torch.log(torch.tensor(40.0)).item()


def test_mtp_loss_in_bf16_is_the_fp32_loss_within_bf16_rounding() -> None:
    """Under CPU autocast (bf16 matmuls, fp32 norms and cross-entropy). Tolerance 1e-3: bf16 rounds each
    matmul output to 2**-9 relative, but at these random weights the logits are near-uniform and the
    cross-entropy moves far less (measured 3e-6 to 2.5e-5 relative over three seeds)."""
    model = _model(depth=2)
    hooks = DEEPSEEK_V3.runtime(model, RuntimeOptions("dropless", 1.25, 1.0))
    ids = torch.randint(0, 40, (2, 13))
    batch = hooks.prepare_batch({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    losses = []
    for dtype in (None, torch.bfloat16):
        autocast = torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None)
        with autocast, hooks.extra_loss(batch) as extra:
            model(batch["input_ids"])
        losses.append(extra.sum.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert losses[1] != losses[0]  # the matmuls did run in bf16


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_depths_take_the_chunked_loss_of_the_main_head(dtype) -> None:
    """With ``trainer.loss=chunked``'s ``output_fn`` the depths' cross-entropy is chunked too (no full
    logits), with the plain path's value: 1e-5 in fp32; in bf16 both project through the same bf16
    matmul and differ in the fp32 summation order only (measured below 1e-6; bound 1e-4)."""
    model = _model(depth=2)
    hooks = DEEPSEEK_V3.runtime(model, RuntimeOptions("dropless", 1.25, 1.0))
    ids = torch.randint(0, 40, (2, 13), generator=torch.Generator().manual_seed(0))
    batch = hooks.prepare_batch({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    sums, calls = [], []
    with_labels = ChunkedLoss.with_labels
    for output_fn in (None, chunked_loss_fn(batch["labels"], chunk_size=5)):
        autocast = torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None)
        with autocast, hooks.extra_loss(batch) as extra, pytest.MonkeyPatch.context() as patch:
            patch.setattr(ChunkedLoss, "with_labels", lambda self, y: calls.append(y) or with_labels(self, y))
            model(batch["input_ids"], output_fn=output_fn)
        sums.append(extra.sum.item())
    assert len(calls) == 2  # each depth's loss was the chunked one, against its own targets
    assert sums[1] == pytest.approx(sums[0], rel=1e-5 if dtype is None else 1e-4)


def test_the_counts_include_the_depths() -> None:
    """Parameters: the built model's; FLOPs per token: the depths' weights, their pass through the
    shared head and their attention (QK^T over head_dim, AV over v_head_dim), 6 FLOPs per multiply-add."""
    with_depth, without = _model(depth=1), _model(depth=0)
    a, b = with_depth.args, without.args
    assert a.num_params() == with_depth.num_params() > b.num_params() == without.num_params()
    extra = a.num_params(active=True) - b.num_params(active=True) + a.vocab_size * a.dim
    attention = 6 * a.n_heads * (a.head_dim + a.v_head_dim) * 64
    assert a.flops_per_token(64) - b.flops_per_token(64) == 6 * extra + attention


def test_read_ahead_targets_stop_at_document_boundaries_and_the_row_end() -> None:
    from portatrain.models.common.mtp import mtp_targets

    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    batch = {
        "input_ids": ids,
        "labels": torch.tensor([[2, 3, -100, 5, 6, 7]]),
        "document_ids": torch.tensor([[0, 0, 0, 1, 1, 1]]),
    }
    out = mtp_targets(batch, depth=2)
    assert out["mtp_tokens"][0, :, 0].tolist() == [2, 3, 4, 5, 6, 0]
    assert out["mtp_tokens"][0, :, 1].tolist() == [3, 4, 5, 6, 0, 0]
    # depth 1 at i predicts labels[i+1] within i's document; depth 2 labels[i+2]
    assert out["mtp_labels"][0, :, 0].tolist() == [3, -100, -100, 6, 7, -100]
    assert out["mtp_labels"][0, :, 1].tolist() == [-100, -100, -100, 7, -100, -100]


def test_the_depth_is_the_published_layer_after_the_main_model() -> None:
    model = _model(depth=1)
    ours = model.state_dict()
    theirs = ds3_hf.to_hf(ours)
    layer = "model.layers.2"  # n_layers=2: the depth is the third layer, as 61 is V3's
    for key in (
        "enorm",
        "hnorm",
        "eh_proj",
        "shared_head.norm",
        "input_layernorm",
        "self_attn.kv_a_proj_with_mqa",
    ):
        assert f"{layer}.{key}.weight" in theirs, key
    assert f"{layer}.mlp.experts.0.gate_proj.weight" in theirs
    torch.testing.assert_close(theirs[f"{layer}.embed_tokens.weight"], ours["embed_tokens.weight"])
    torch.testing.assert_close(theirs[f"{layer}.shared_head.head.weight"], ours["lm_head.weight"])
    back = ds3_hf.from_hf(theirs)
    assert sorted(back) == sorted(ours)
    for key, value in ours.items():
        torch.testing.assert_close(back[key], value)
    assert ds3_hf.hf_config(model.args)["num_nextn_predict_layers"] == 1


MTP_RUN = [
    *TINY,
    "model=deepseek_v3_debug",
    "model.mtp_layers=2",
    "trainer.steps=3",
    "checkpoint.enabled=false",
]


PP2 = ["parallel.pp=2", "parallel.pp_microbatches=2"]
BF16_TIED = [*BF16, "model.tie_embeddings=true"]

two_processes = shared_launch.declare(
    "two_processes",
    2,
    {
        "fsdp2": [*MTP_RUN, "parallel.dp_shard=2", "data.batch_size=2"],
        "cp2": [*MTP_RUN, "parallel.cp=2"],
        # the depths' mixture of experts split over the ranks with the main blocks'
        "ep2": [*MTP_RUN, "parallel.dp_shard=2", "parallel.ep=2", "data.batch_size=2"],
        "pp2": [*MTP_RUN[:-1], *PP2, "checkpoint.every=2"],
        # bf16, and one matrix at both ends: the last stage's copy is the head and the depths' embedding
        "pp2_bf16_tied": [*MTP_RUN, *PP2, *BF16_TIED],
    },
)


@pytest.mark.slow
def test_fsdp2_cp2_ep2_and_pp2_on_two_processes_match_one(two_processes, tmp_path: Path) -> None:
    """Two depths on packed 64-token rows (documents cross the context-parallel shards): FSDP2 (half
    the global batch of 4 per rank), context parallel (each rank two chunks of every row, reading
    ahead into the other's), expert parallel (4 of the 8 experts per rank, the depths' too) and
    pipeline parallel (the depths on the last stage with its copy of the embedding, whose gradient is
    summed with the first stage's) give one process's losses and gradient norms, MTP loss included;
    the pipeline's checkpoint resumes in one process."""
    fit(MTP_RUN, tmp_path / "one")
    dirs = two_processes
    want = train_records(tmp_path / "one")
    assert all(r["mtp_loss"] > 0 for r in want)
    # The pipeline's step-2 checkpoint (the embedding saved once, from both stages) in one process.
    fit(
        [*MTP_RUN, f"checkpoint.resume={dirs['pp2'] / 'checkpoints' / 'step_0000002'}"], tmp_path / "pp2_to_1"
    )
    for name, run_dir in [
        *((n, d) for n, d in dirs.items() if n != "pp2_bf16_tied"),
        ("pp2_to_1", tmp_path / "pp2_to_1"),
    ]:
        got = train_records(run_dir)
        # Indices into want: steps 1-3, or step 3 after the resume at step 2.
        steps = [2] if name == "pp2_to_1" else [0, 1, 2]
        assert [r["step"] for r in got] == [want[i]["step"] for i in steps] == [i + 1 for i in steps], name
        for g, w in zip(got, [want[i] for i in steps], strict=True):
            assert g["loss"] == pytest.approx(w["loss"], abs=1e-5), (name, g, w)
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (name, g, w)
            if name.startswith("pp2"):  # the whole batch's depths on the last stage, summed to rank 0
                assert g["mtp_loss"] == pytest.approx(w["mtp_loss"], abs=1e-5), (name, g, w)


@pytest.mark.slow
def test_pp2_in_bf16_with_tied_embeddings_matches_one_process_within_the_derived_bound(
    two_processes, tmp_path: Path
) -> None:
    """Autocast bf16 (fp32 parameters and gradients) under pp=2 with the depths and the tied head on the
    last stage, against one process in bf16. Two bf16 runs of the main blocks and the depths, each
    depth a block on the deepest path: the bound of tests/helpers.py for ``n_layers + mtp_layers``
    blocks, twice (losses 9.9e-2, gradient norms 1.7e-1 relative; measured 3e-5 and 3e-4)."""
    fit([*MTP_RUN, *BF16_TIED], tmp_path / "one")
    want = train_records(tmp_path / "one")
    got = train_records(two_processes["pp2_bf16_tied"])
    args = model_args(compose_config(MTP_RUN).model)
    blocks = args.n_layers + args.mtp_layers
    loss_bound = bf16_tolerance(2 * decoder_roundings(blocks))
    grad_bound = bf16_tolerance(2 * decoder_roundings(blocks, backward=True))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        assert math.isfinite(g["loss"]) and g["mtp_loss"] > 0, g
        assert g["loss"] == pytest.approx(w["loss"], rel=loss_bound), (g, w)
        assert g["mtp_loss"] == pytest.approx(w["mtp_loss"], rel=loss_bound), (g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=grad_bound), (g, w)


def test_pipeline_parallel_with_mtp_validates_but_a_v_schedule_is_one_line_naming_the_fix() -> None:
    pp = [*MTP_RUN, "parallel.pp=2", "dry_run=true"]
    assert config_problems(compose_config(pp)) == []
    v_shape = ["parallel.pp_schedule=ZBVZeroBubble", "parallel.pp_virtual_stages=2"]
    problems = config_problems(compose_config([*pp, *v_shape, "parallel.activation_checkpointing=none"]))
    assert [p for p in problems if "mtp_layers" in p] == [
        "parallel.pp_schedule=ZBVZeroBubble with model.mtp_layers=2: the last stage's copy of the embedding "
        "is summed with the first stage's across pipeline ranks, and a V places both stages on rank 0; use "
        "parallel.pp_schedule=Interleaved1F1B (or InterleavedZeroBubble)"
    ]


def test_init_from_reads_the_depth_and_a_model_without_one_skips_it(tmp_path: Path) -> None:
    """A Hugging Face directory with the depth as layer 2 (as DeepSeek-V3's layer 61, with its copies of
    the embedding and head) loads into a model with one depth exactly, and into one without it."""
    from safetensors.torch import save_file

    from portatrain.checkpoint.hf import load_hf_weights

    source = _model(depth=1)
    (tmp_path / "config.json").write_text(json.dumps(ds3_hf.hf_config(source.args, torch_dtype="float32")))
    save_file(
        {k: v.contiguous() for k, v in ds3_hf.to_hf(source.state_dict()).items()}, tmp_path / "m.safetensors"
    )
    for depth in (1, 0):
        torch.manual_seed(1)
        model = DEEPSEEK_V3.model_cls(dataclasses.replace(source.args, mtp_layers=depth))
        model.init_weights()
        load_hf_weights(model, tmp_path, DEEPSEEK_V3)
        got, want = model.state_dict(), source.state_dict()
        assert set(got) == {k for k in want if depth or not k.startswith("mtp.")}
        for key, value in got.items():
            torch.testing.assert_close(value, want[key], msg=key)


def test_a_resume_adds_or_drops_the_depths(tmp_path: Path) -> None:
    """Depths added on resume start fresh and depths dropped are not read; the main model resumes
    exactly either way. With mtp_loss_weight=0 the depths do not touch the main model, so a run that
    adds them at step 2 and drops them again at step 3 has the losses of one that never had them."""
    base = [
        *MTP_RUN[:-2],
        "trainer.steps=4",
        "trainer.eval_every=0",
        "checkpoint.every=1",
        "checkpoint.keep=0",
    ]
    plain = [o for o in base if not o.startswith("model.mtp_layers")]
    fit(plain, tmp_path / "plain")
    step = str(tmp_path / "{}/checkpoints/step_{:07d}")
    fit([*base, "model.mtp_loss_weight=0", f"checkpoint.resume={step.format('plain', 2)}"], tmp_path / "add")
    fit([*plain, f"checkpoint.resume={step.format('add', 3)}"], tmp_path / "drop")
    want = {r["step"]: r["loss"] for r in train_records(tmp_path / "plain")}
    added, dropped = train_records(tmp_path / "add"), train_records(tmp_path / "drop")
    assert [r["step"] for r in added] == [3, 4] and all("mtp_loss" in r for r in added)
    assert [r["step"] for r in dropped] == [4] and "mtp_loss" not in dropped[0]
    for r in [*added, *dropped]:
        assert r["loss"] == pytest.approx(want[r["step"]], abs=1e-6), (r, want)


def test_a_save_with_checkpointed_depths_resumes_without_checkpointing(tmp_path: Path) -> None:
    """Activation checkpointing wraps the depths as the main blocks; the checkpoint's names stay the
    unwrapped ones, so a run saved under ``full`` resumes without it with the uninterrupted losses."""
    run = [*MTP_RUN[:-2], "trainer.steps=4", "trainer.eval_every=0", "checkpoint.every=2"]
    fit([*run, "parallel.activation_checkpointing=full"], tmp_path / "full")
    saved = tmp_path / "full" / "checkpoints" / "step_0000002"
    fit([*run, f"checkpoint.resume={saved}"], tmp_path / "resumed")
    want = {r["step"]: r for r in train_records(tmp_path / "full")}
    got = train_records(tmp_path / "resumed")
    assert [r["step"] for r in got] == [3, 4]
    for r in got:
        assert r["loss"] == pytest.approx(want[r["step"]]["loss"], abs=1e-6), (r, want[r["step"]])
        assert r["mtp_loss"] == pytest.approx(want[r["step"]]["mtp_loss"], abs=1e-6)
