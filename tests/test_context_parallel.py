"""Context parallelism (``parallel.cp``): the sharding and attention math in one process, bad input,
and -- slow tier, under torchrun -- losses and gradients against one process."""

from __future__ import annotations

import pytest
import torch

from portatrain.data.collate import document_causal_mask
from portatrain.models.attention import causal_attention
from portatrain.parallel.context import (
    ContextParallel,
    ShardedAttention,
    chunk_order,
    context_problems,
    shard_sequence,
    unshard_sequence,
)
from portatrain.parallel.parallel_dims import layout_problems
from tests import shared_launch
from tests.helpers import TINY, bf16_tolerance, decoder_roundings, relative_error, spawn


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shards_are_head_and_tail_chunks_and_reassemble(cp):
    row = torch.arange(2 * 8 * cp).view(2, -1)
    shards = [shard_sequence(row, cp, rank) for rank in range(cp)]
    c = row.shape[1] // (2 * cp)
    for rank, shard in enumerate(shards):
        assert shard[0, :c].tolist() == list(range(rank * c, (rank + 1) * c))
        tail = 2 * cp - 1 - rank
        assert shard[0, c:].tolist() == list(range(tail * c, (tail + 1) * c))
    assert torch.equal(unshard_sequence(torch.cat(shards, dim=1), cp, dim=1), row)
    # Causal work is balanced: every rank's two chunks attend (2cp + 1) * c keys in all.
    assert {sum(j + 1 for j in chunk_order(cp)[2 * r : 2 * r + 2]) for r in range(cp)} == {2 * cp + 1}


def _emulated_ranks(q, k, v, cp, document_ids):
    """Every cp rank's ShardedAttention output, in one process: each rank's gather returns what the
    all-gather would, built from the full (leaf) k and v so gradients reach them."""

    def local(rank):
        ks, vs = shard_sequence(k, cp, rank, dim=2), shard_sequence(v, cp, rank, dim=2)
        return torch.cat([ks, vs], dim=-1).permute(2, 0, 1, 3)

    outs = []
    for rank in range(cp):
        attention = ShardedAttention(
            seq_len=q.shape[2],
            cp=cp,
            rank=rank,
            gather=lambda x: torch.cat([local(r) for r in range(cp)]),
            document_ids=document_ids,
        )
        outs.append(
            attention(
                shard_sequence(q, cp, rank, 2), shard_sequence(k, cp, rank, 2), shard_sequence(v, cp, rank, 2)
            )
        )
    return unshard_sequence(torch.cat(outs, dim=2), cp, dim=2)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("kernel", ["cpu", "fused"])
def test_sharded_attention_matches_full_attention_and_its_gradients(cp, documents, kernel, monkeypatch):
    """Every cp rank's attention, put back in row order, is one process's, gradients included; both
    the CPU path and, forced on CPU, the path taken elsewhere (repeated heads, causal_lower_right)."""
    if kernel == "fused":
        monkeypatch.setattr("portatrain.parallel.context.cpu_flash_kernel", lambda device: False)
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 16 * cp, 8  # grouped-query: 2 query heads per kv head
    q = torch.randn(batch, heads, seq, dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, requires_grad=True)
    # values narrower than keys, as latent attention's (DeepSeek-V3)
    v = torch.randn(batch, kv_heads, seq, dim - 2, requires_grad=True)
    document_ids = None
    if documents:  # documents cross the shard boundaries; the padded tail is a document of its own
        document_ids = torch.tensor(
            [[0] * 5 + [1] * (seq - 9) + [2] * 4, [0] * (seq // 2 + 3) + [1] * (seq // 2 - 3)]
        )
    mask = None if document_ids is None else document_causal_mask(document_ids)
    reference = causal_attention(q, k, v, mask)
    weights = torch.randn_like(reference)
    grads = torch.autograd.grad((reference * weights).sum(), (q, k, v))

    sharded = _emulated_ranks(q, k, v, cp, document_ids)
    torch.testing.assert_close(sharded, reference, atol=1e-5, rtol=1e-5)
    for got, want in zip(torch.autograd.grad((sharded * weights).sum(), (q, k, v)), grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_shard_batch_keeps_original_positions_and_carries_document_ids():
    cp, seq = 2, 8
    batch = {
        "input_ids": torch.arange(seq)[None],
        "labels": torch.arange(1, seq + 1)[None],
        "positions": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
        "document_ids": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32),
    }
    shard = ContextParallel(cp, 1, gather=lambda x: x).shard_batch(batch)
    assert shard["input_ids"].tolist() == [[2, 3, 4, 5]]  # chunks 1 and 2 of 4
    assert shard["positions"].tolist() == [[2, 0, 1, 2]]
    assert "document_ids" not in shard and isinstance(shard["attn_mask"], ShardedAttention)
    assert torch.equal(shard["attn_mask"].document_ids, batch["document_ids"])  # the whole row's
    unpacked = ContextParallel(cp, 0, gather=lambda x: x).shard_batch({"input_ids": torch.zeros(1, seq)})
    assert unpacked["positions"].tolist() == [[0, 1, 6, 7]]  # 0..S-1 when the batch has none


def test_bad_context_parallel_input_is_one_line_each():
    (uneven,) = context_problems(4, 1, [64, 100], "data.buckets")
    assert "[100]" in uneven and "2 * parallel.cp(4) = 8" in uneven and "multiples of 8" in uneven
    (with_tp,) = context_problems(2, 2, [36], "data.seq_len")
    assert "2 * parallel.cp(2) * parallel.tp(2) = 8" in with_tp
    assert context_problems(2, 2, [64], "data.seq_len") == []
    (world,) = layout_problems(dp_replicate=1, dp_shard=2, tp=1, world_size=2, cp=2)
    assert "dp_shard(2) * cp(2) * tp(1) = 4 != world size 2" in world and "parallel.dp_shard=1" in world
    (inferred,) = layout_problems(dp_replicate=1, dp_shard=-1, tp=1, world_size=6, cp=4)
    assert "cp(4)" in inferred and "does not divide world size 6" in inferred
    assert layout_problems(dp_replicate=1, dp_shard=-1, tp=1, world_size=8, cp=4) == []
    assert any("ep=2 with parallel.cp=2" in p for p in layout_problems(1, 2, 1, 4, 2, cp=2))


# -- slow tier: every family, with and without document masks, against one process -------------
# One launch of 4 ranks runs every case (process-group start-up is the expensive part); each rank
# computes the one-process reference on the full batch itself, so a case needs no second launch.
ROWS, SEQ = 2, 32
PARITY_CASES = [
    # (family, cp, tp, documents): dp_shard = 4 / (cp * tp); the debug flavours are grouped-query
    # (2 query heads per kv head).
    ("llama3", 4, 1, True),
    ("llama3", 2, 1, False),
    ("llama3", 2, 2, True),
    ("qwen3", 2, 1, True),
    ("olmo2", 4, 1, True),
    ("qwen3_moe", 2, 1, True),
]
BF16_CASES = [
    # The same in bf16, as the Trainer runs it: the reference under autocast over fp32 weights, the
    # layout under autocast with FSDP2's bf16 parameters (fp32 gradient reduction). cp2 x tp2 (FSDP2
    # over cp), and cp2 x dp_shard 2 of the mixture of experts (dropless; rows split over dp too).
    ("llama3", 2, 2, True),
    ("qwen3_moe", 2, 1, True),
]


def _batch(vocab: int, documents: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=gen)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
    if documents:  # boundaries inside chunks and on chunk edges; a -100 padded tail is one more
        lengths = [[5, 11, 9, 7], [16, 16]]
        ids = [sum(([d] * n for d, n in enumerate(row)), []) for row in lengths]
        batch["document_ids"] = torch.tensor(ids, dtype=torch.int32)
        batch["positions"] = torch.tensor([sum((list(range(n)) for n in row), []) for row in lengths])
        batch["labels"][0, -7:] = -100
    return batch


def _loss_and_grads(model, batch, total_tokens: int, dtype: torch.dtype = torch.float32):
    from portatrain.losses import cross_entropy_sum

    positions, mask = batch.get("positions"), batch.get("attn_mask")
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logits = model(batch["input_ids"], positions=positions, attn_mask=mask)
    loss = cross_entropy_sum(logits, batch["labels"])
    (loss / total_tokens).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[name.replace("_checkpoint_wrapped_module.", "")] = grad
    return loss.detach() / total_tokens, grads


def _build(family: str, dims=None, param_dtype: torch.dtype = torch.float32):
    from dataclasses import replace

    from portatrain.models import get_spec
    from portatrain.models.common.moe import configure_moe
    from portatrain.parallel.utils import full_tensor_init, token_all_reduce

    spec = get_spec(family)
    args = replace(spec.flavors["debug"], n_layers=2, max_seq_len=64)
    with torch.device("meta"):
        model = spec.model_cls(args)
    reduce = None if dims is None else (lambda t: token_all_reduce(t, dims))
    configure_moe(model, dispatch="dropless", capacity_factor=1.25, aux_loss_scale=1.0, reduce_stats=reduce)
    if dims is not None:
        spec.parallelize(model, dims, param_dtype=param_dtype, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad(), full_tensor_init():
        model.init_weights()
    return model, args


def _parity_worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from portatrain.data.collate import with_attention_mask
    from portatrain.parallel import ParallelDims
    from portatrain.parallel.utils import token_all_reduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    errors = []
    bf16 = torch.bfloat16
    try:
        cases = [(*case, torch.float32) for case in PARITY_CASES] + [(*case, bf16) for case in BF16_CASES]
        for family, cp, tp, documents, dtype in cases:
            dims = ParallelDims(dp_replicate=1, dp_shard=-1, tp=tp, world_size=world, cp=cp)
            dims.build_mesh("cpu")
            reference, args = _build(family)
            full = _batch(args.vocab_size, documents)
            total = int((full["labels"] != -100).sum())
            want_loss, want = _loss_and_grads(reference, with_attention_mask(full), total, dtype)

            model, _ = _build(family, dims, param_dtype=dtype)
            rows = slice(dims.dp_rank * ROWS // dims.dp, (dims.dp_rank + 1) * ROWS // dims.dp)
            shard = ContextParallel.from_mesh(dims.cp_mesh).shard_batch({k: v[rows] for k, v in full.items()})
            loss, got = _loss_and_grads(model, shard, total, dtype)
            loss = token_all_reduce(loss, dims)
            case = f"{family} cp={cp} tp={tp} documents={documents} {dtype}"
            if dtype == bf16:
                # Two bf16 computations of a two-block decoder (tests/helpers.py): the loss within the
                # logits' bound, all gradients together within the gradients' (single parameters' may
                # be far smaller than the rest, the router's, and are not judged alone).
                loss_bound = bf16_tolerance(2 * decoder_roundings(args.n_layers))
                grad_bound = bf16_tolerance(2 * decoder_roundings(args.n_layers, backward=True))
                if relative_error(loss, want_loss) > loss_bound:
                    errors.append(f"{case}: loss {loss.item()} != {want_loss.item()} within {loss_bound:.2e}")
                names = sorted(want)
                grad_error = relative_error([got[n] for n in names], [want[n] for n in names])
                if grad_error > grad_bound:
                    errors.append(f"{case}: gradients differ by {grad_error:.2e} > {grad_bound:.2e}")
                continue
            if not torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-6):
                errors.append(f"{case}: loss {loss.item()} != {want_loss.item()}")
            for name, grad in want.items():
                if not torch.allclose(got[name], grad, rtol=1e-5, atol=1e-6):
                    diff = (got[name] - grad).abs().max().item()
                    errors.append(f"{case}: gradient of {name} differs by {diff:.2e}")
        if rank == 0:
            torch.save(errors, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_context_parallel_matches_one_process_for_every_family(tmp_path):
    """Loss and every parameter's gradient under cp=2 (with FSDP2 over dp_shard x cp, and with TP)
    and cp=4 equal one process's on the same global batch, to fp32 rounding; in bf16 (cp2 x tp2, and
    the mixture of experts at cp2 x dp2), within the bound derived in ``tests/helpers.py``."""
    out = tmp_path / "errors.pt"
    spawn(_parity_worker, (4, str(out)), nprocs=4)
    assert torch.load(out, weights_only=True) == []


two_processes = shared_launch.declare(
    "two_processes", 2, {"cp2": [*TINY, "checkpoint.every=2", "parallel.cp=2"]}
)


@pytest.mark.slow
def test_cp2_matches_one_process_and_resumes_at_cp1(two_processes, tmp_path):
    """cp=2 on 2 processes (packed rows with document masks, the default collator) logs one
    process's losses; its step-2 checkpoint resumes on one process at cp=1 and the next steps'
    losses match the uninterrupted run's."""
    from tests.helpers import fit, step_losses

    fit(["checkpoint.every=2"], tmp_path / "one")
    want = step_losses(tmp_path / "one")
    got = step_losses(two_processes["cp2"])
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    resumed = tmp_path / "resumed"
    fit([f"checkpoint.resume={two_processes['cp2'] / 'checkpoints' / 'step_0000002'}"], resumed)
    after = step_losses(resumed)
    assert sorted(after) == [3, 4] and after == pytest.approx({s: want[s] for s in (3, 4)}, rel=1e-5)


def test_config_validation_reports_context_parallel_problems(monkeypatch):
    from portatrain.validate import config_problems
    from tests.helpers import TINY, compose_config

    monkeypatch.setenv("WORLD_SIZE", "4")
    problems = config_problems(
        compose_config([*TINY, "parallel.cp=4", "data.seq_len=68", "parallel.dp_shard=2"])
    )
    assert any(
        "data.seq_len has row length(s) [68] not divisible by 2 * parallel.cp(4) = 8" in p for p in problems
    )
    assert any(
        "dp_shard(2) * cp(4) * tp(1) = 8 != world size 4; set parallel.dp_shard=1" in p for p in problems
    )
    buckets = compose_config([*TINY, "parallel.cp=2", "data.collator=bucket", "data.buckets=[32,62]"])
    (bucket,) = config_problems(buckets)
    assert "data.buckets has row length(s) [62] not divisible by 2 * parallel.cp(2) = 4" in bucket
    assert config_problems(compose_config([*TINY, "parallel.cp=4"])) == []  # dp_shard=-1 takes 1
