"""The memory-lean chunked loss (``portatrain.losses``, ``trainer.loss=chunked``) against the plain one.

Values and gradients must match the plain ``F.cross_entropy`` over full logits to fp32 rounding: on
bare tensors (ragged last chunk, ignored labels, scaled backward), through the Trainer (plain and
chunked runs train to the same losses, a ``compute_loss`` override keeps the plain path), with
compiled blocks, and on 4 gloo ranks under FSDP2 x tensor parallel, untied and tied (the
vocabulary-parallel path), against one process.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from portatrain.losses import chunked_cross_entropy, cross_entropy_sum, loss_problems
from tests.helpers import fit, read_metrics, spawn


def _plain_and_chunked(hidden, weight, labels, chunk_size, scale=0.37):
    results = []
    for fn in (
        lambda h, w: cross_entropy_sum(F.linear(h, w), labels),
        lambda h, w: chunked_cross_entropy(h, w, labels, chunk_size=chunk_size),
    ):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w)
        (loss * scale).backward()  # the trainer scales by 1 / tokens: backward must carry it
        results.append((loss.detach(), h.grad, w.grad))
    return results


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunked_loss_matches_plain_values_and_gradients(chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 41, 24, generator=gen)
    weight = torch.randn(293, 24, generator=gen) * 0.3
    labels = torch.randint(0, 293, (3, 41), generator=gen)
    labels[0, :9] = -100  # padding / prompt positions carry no loss and no gradient
    labels[2, -1] = -100
    (plain, dh_plain, dw_plain), (chunked, dh, dw) = _plain_and_chunked(hidden, weight, labels, chunk_size)
    assert chunked.dtype == torch.float32 and chunked.shape == ()
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=0)
    torch.testing.assert_close(dh, dh_plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, dw_plain, rtol=1e-5, atol=1e-6)
    assert dh[0, :9].abs().max() == 0  # ignored positions get no gradient


def test_chunked_loss_without_grad_and_errors() -> None:
    hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
    labels = torch.randint(0, 11, (2, 5))
    with torch.no_grad():
        got = chunked_cross_entropy(hidden, weight, labels, chunk_size=3)
    torch.testing.assert_close(got, cross_entropy_sum(F.linear(hidden, weight), labels), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="labels must have the hidden states' shape"):
        chunked_cross_entropy(hidden, weight, labels[:, :4])
    assert loss_problems("fused", 0) == [
        "trainer.loss='fused' is not one of plain, chunked",
        "trainer.loss_chunk_size=0 must be positive (positions per chunk, e.g. 1024)",
    ]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.parametrize(
    "extra",
    # Compiled per block, the head and the loss stay eager (compile.granularity) and both runs use
    # the same graphs (dynamo caches them per code object: the chunked run compiles none), so
    # inductor's code generation adds nothing to the comparison but ~35 CPU-s: aot_eager traces the
    # blocks and their backward the same way.
    [[], ["compile.enabled=true", "compile.backend=aot_eager"], ["model=qwen3_debug"]],
    ids=["llama-eager", "llama-compiled", "qwen3-tied"],
)
def test_trainer_chunked_loss_trains_like_the_plain_loss(extra: list[str], tmp_path: Path) -> None:
    base = ["trainer.steps=3", "trainer.eval_every=3", "trainer.eval_batches=1", *extra]
    fit(base, tmp_path / "plain")
    trainer = fit([*base, "trainer.loss=chunked", "trainer.loss_chunk_size=48"], tmp_path / "chunked")
    assert trainer._loss_chunk_size == 48
    plain, chunked = _losses(tmp_path / "plain"), _losses(tmp_path / "chunked")
    assert len(plain) == 3
    assert chunked == pytest.approx(plain, rel=1e-5)
    evals = [
        [r["eval_loss"] for r in read_metrics(tmp_path / d) if "eval_loss" in r] for d in ("plain", "chunked")
    ]
    assert evals[1] == pytest.approx(evals[0], rel=1e-5) and evals[0]


def test_overridden_compute_loss_keeps_the_plain_path(tmp_path: Path) -> None:
    from portatrain.trainer import Trainer

    class Doubled(Trainer):
        calls = 0

        def compute_loss(self, logits, batch):
            assert logits.shape[-1] == self.model.args.vocab_size  # the hook still sees full logits
            Doubled.calls += 1
            return 2 * super().compute_loss(logits, batch)

    trainer = fit(["trainer.steps=2", "trainer.loss=chunked"], tmp_path, trainer_cls=Doubled)
    assert trainer._loss_chunk_size is None and Doubled.calls == 2


# -- FSDP2 x tensor parallel on 4 gloo ranks -----------------------------------------------------

ROWS, SEQ, STEPS = 4, 16, 2


def _model_args(tied: bool):
    from portatrain.models.llama import LLAMA3

    return replace(LLAMA3.flavors["debug"], n_layers=2, max_seq_len=64, tie_embeddings=tied)


def _train(model, *, rows: slice, chunked: bool) -> list[float]:
    args = model.args
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, args.vocab_size, (ROWS, SEQ + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[1, :3] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for _ in range(STEPS):
        if chunked:
            loss = model(
                inputs[rows],
                output_fn=lambda h, w: chunked_cross_entropy(h, w, labels[rows], chunk_size=24),
            )
        else:
            loss = cross_entropy_sum(model(inputs[rows]), labels[rows])
        (loss / (labels != -100).sum()).backward()
        losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _worker(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from portatrain.models.llama import LLAMA3
        from portatrain.parallel import ParallelDims
        from portatrain.parallel.utils import full_tensor_init

        dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, world_size=world)
        dims.build_mesh("cpu")
        record = {}
        for tied in (False, True):
            with torch.device("meta"):
                model = LLAMA3.model_cls(_model_args(tied))

            def compile_block(block: torch.nn.Module) -> torch.nn.Module:
                block.compile(backend="aot_eager", fullgraph=True)
                return block

            LLAMA3.parallelize(model, dims, compile_block=compile_block)
            model.to_empty(device="cpu")
            torch.manual_seed(0)
            with full_tensor_init():
                model.init_weights()
            rows = slice(dims.dp_rank * ROWS // dims.dp, (dims.dp_rank + 1) * ROWS // dims.dp)
            losses = torch.stack(_train(model, rows=rows, chunked=True))
            dist.all_reduce(losses, group=dims.dp_mesh.get_group())  # tp ranks hold the same value
            record[tied] = losses.tolist()
        if rank == 0:
            torch.save(record, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_chunked_loss_under_fsdp2_and_tensor_parallel_matches_one_process(tmp_path: Path) -> None:
    out = tmp_path / "rank0.pt"
    spawn(_worker, (4, str(out)), nprocs=4)
    got = torch.load(out, weights_only=True)
    from portatrain.models.llama import Llama

    for tied in (False, True):
        model = Llama(_model_args(tied))
        torch.manual_seed(0)
        model.init_weights()
        want = [float(x) for x in _train(model, rows=slice(0, ROWS), chunked=False)]
        assert got[tied] == pytest.approx(want, rel=1e-5), (tied, got[tied], want)
