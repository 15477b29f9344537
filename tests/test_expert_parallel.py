"""Expert parallelism (``parallel.ep``, ``portatrain.parallel.expert``).

* Bad layouts are refused by validation, one line each with the fix, before any process starts:
  ``ep`` not dividing the ``dp_shard`` ranks or the experts, ``ep > 1`` on a dense model, and capacity
  dispatch (which exchanges equal-size buffers) where ranks may run different row lengths.
* The exchange on two gloo ranks against the single-device layer on each rank's tokens, in both
  dispatch modes, capacity with tokens dropped, in fp32 and in bf16 (autocast; the rows travel in
  bf16): outputs, input and router gradients, and each rank's experts' gradients (the sum over both
  ranks' tokens); the elements every all-to-all moved, forward and backward, against the analytic
  amount.
* Training under ``torchrun``: ``ep=2`` on 2 processes (both modes; dropless with compiled blocks and
  full activation checkpointing) and on 4 (``dp_shard=4``) equal to one process on the same global batch; a checkpoint saved at ``ep=2`` holds each expert weight
  as one ``[n_experts, ...]`` tensor and resumes in one process with the next losses unchanged. The
  runs train in the session's launch of their world size (``tests/shared_launch.py``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from portatrain.errors import ConfigError
from portatrain.models import get_spec
from portatrain.models.common.moe import GroupedExperts, MoE
from portatrain.parallel.parallel_dims import ParallelDims, layout_problems
from tests import shared_launch
from tests.helpers import (
    TINY,
    bf16_tolerance,
    compose_config,
    fit,
    relative_error,
    spawn,
    train_records,
)
from tests.test_command_errors import run

MOE = [*TINY, "model=qwen3_moe_debug"]  # 8 experts, top-2; TINY: 4 steps of 4 rows of 64 tokens
STEPS = 4


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def test_ep_must_divide_the_dp_shard_ranks_given_or_inferred() -> None:
    (given,) = layout_problems(dp_replicate=1, dp_shard=6, tp=1, world_size=6, ep=4)
    assert "parallel.ep=4 must divide the data-parallel shard ranks dp_shard=6" in given
    assert "set parallel.ep in [1, 2, 3, 6]" in given
    (inferred,) = layout_problems(dp_replicate=2, dp_shard=-1, tp=1, world_size=6, ep=2)
    assert "dp_shard=3 (inferred from the world size)" in inferred
    assert layout_problems(dp_replicate=1, dp_shard=4, tp=1, world_size=4, ep=0) == [
        "parallel.ep=0 must be >= 1"
    ]
    assert layout_problems(dp_replicate=2, dp_shard=-1, tp=1, world_size=8, ep=4) == []
    with pytest.raises(ConfigError, match="parallel.ep=3 must divide"):
        ParallelDims(dp_replicate=1, dp_shard=4, tp=1, world_size=4, ep=3)
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, tp=1, world_size=4, ep=2)
    assert dims.ep_enabled and "ep=2" in dims.describe()


def test_the_capacity_experts_return_a_tensor_of_their_own_not_a_view() -> None:
    """FSDP2 wraps ``GroupedExperts.batched`` as a forward method and warns on every rank when it
    returns a view ("returned a view tensor ... wrong gradients", the expert-parallel bench's noise)."""
    experts = GroupedExperts(n_experts=4, dim=8, hidden_dim=6)
    experts.init_weights(0.02, 0.02)
    out = experts.batched(torch.randn(4, 3, 8), torch.rand(4, 3))
    assert out.shape == (4, 3, 8) and out._base is None


def test_the_shared_plan_refuses_ep_over_a_dense_model_or_uneven_experts() -> None:
    moe_cfg = compose_config(["model=qwen3_moe_debug", "parallel.ep=3"])
    spec = get_spec("qwen3_moe")
    args = spec.flavors["debug"]
    (uneven,) = spec.parallel_problems(moe_cfg.parallel, args)
    assert "parallel.ep=3 must divide model.n_experts=8" in uneven and "[1, 2, 4, 8]" in uneven
    dense_cfg = compose_config(["model=qwen3_debug", "parallel.ep=2"])
    dense = get_spec("qwen3")
    (problem,) = dense.parallel_problems(dense_cfg.parallel, dense.flavors["debug"])
    assert (
        "parallel.ep=2: this model has no mixture-of-experts layer" in problem and "parallel.ep=1" in problem
    )
    assert (
        spec.parallel_problems(compose_config(["model=qwen3_moe_debug", "parallel.ep=4"]).parallel, args)
        == []
    )


def test_bad_ep_is_one_error_each_in_a_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # in this process (``portatrain`` as the CLI runs it): six dry runs

    def dry_run(*overrides: str) -> tuple[int, str]:
        return run(["device=cpu", "dry_run=true", *overrides], capsys)

    status, err = dry_run("model=qwen3_moe_debug", "parallel.dp_shard=6", "parallel.ep=3")
    assert status == 2 and "Traceback" not in err, err[-3000:]
    assert "parallel.ep=3 must divide model.n_experts=8" in err  # dp_shard=6 is fine
    status, err = dry_run("model=qwen3_moe_debug", "parallel.dp_shard=2", "parallel.ep=4")
    assert status == 2 and "parallel.ep=4 must divide the data-parallel shard ranks dp_shard=2" in err
    status, err = dry_run("model=qwen3_debug", "parallel.dp_shard=2", "parallel.ep=2")
    assert status == 2 and "this model has no mixture-of-experts layer" in err
    buckets = ["model=qwen3_moe_debug", "parallel.dp_shard=2", "parallel.ep=2", "data.collator=bucket"]
    status, err = dry_run(*buckets, "model.moe_dispatch=capacity")
    assert status == 2 and "ranks may run different row lengths in one step" in err
    assert dry_run(*buckets, "model.moe_dispatch=dropless")[0] == 0
    status, err = dry_run("model=qwen3_moe_debug", "parallel.dp_shard=4", "parallel.ep=2")
    assert status == 0, err[-3000:]


# ---------------------------------------------------------------------------------------------
# The exchange on two ranks, against the single-device layer
# ---------------------------------------------------------------------------------------------

DIM, HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 8, 4, 2, 24


class _AllToAllElements(TorchDispatchMode):
    """Counts the elements each all-to-all sends from this rank (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0
        self.float_dtypes: set[torch.dtype] = set()  # of the rows, weights and gradients (not the counts)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            self.elements += args[0].numel()
            if args[0].is_floating_point():
                self.float_dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def _exchange_worker(rank: int, store: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from portatrain.parallel.expert import apply_ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        local = EXPERTS // 2
        dropped = torch.zeros(())
        for dtype, dispatch in [
            (dtype, d) for dtype in (torch.float32, torch.bfloat16) for d in ("capacity", "dropless")
        ]:
            torch.manual_seed(0)
            ref = MoE(DIM, HIDDEN, EXPERTS, TOP_K, norm_topk_prob=True, aux_loss_coef=0.01)
            ref.init_weights(0.5, 0.5)
            ref.dispatch, ref.capacity_factor = dispatch, 0.75  # capacity: 9 slots for ~12 per expert
            layer = copy.deepcopy(ref)
            apply_ep([layer], mesh)
            torch.manual_seed(1 + rank)  # each rank its own tokens
            x = torch.randn(2, TOKENS // 2, DIM)
            grad = torch.randn_like(x)
            x_ref, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
            # bf16 as the Trainer computes it: autocast over fp32 weights.
            bf16 = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
            with bf16:
                want = ref(x_ref)
            want.backward(grad)
            with _AllToAllElements() as sent, bf16:
                got = layer(x_ep)
                got.backward(grad)
            full_grads, mine_grads = [], []
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(ref.experts, name).grad.clone()
                dist.all_reduce(full)  # every rank's tokens reach this rank's experts
                full_grads.append(full[rank * local : (rank + 1) * local])
                mine_grads.append(getattr(layer.experts, name).grad.to_local())
            pairs = [
                (got, want),
                (x_ep.grad, x_ref.grad),
                (layer.gate.weight.grad, ref.gate.weight.grad),
                *zip(mine_grads, full_grads, strict=True),
            ]
            if dtype == torch.float32:
                for a, b in pairs:
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            else:
                # The rows travel in bf16; each expert computes the same products on either side, so the
                # two differ by summation order only. Bound (tests/helpers.py): one sublayer's 4
                # roundings on each side, and three times that for gradients.
                assert sent.float_dtypes == {torch.bfloat16}, sent.float_dtypes
                assert got.dtype == torch.float32  # combined in the activations' dtype
                for i, (a, b) in enumerate(pairs):
                    bound = bf16_tolerance(2 * 4 * (1 if i == 0 else 3))
                    assert relative_error(a, b) <= bound, (dispatch, i, relative_error(a, b), bound)
            if dispatch == "capacity":
                slots = ref.capacity(TOKENS)
                # rows and routing weights out, rows back; the same again in backward
                assert sent.elements == 4 * EXPERTS * slots * DIM + 2 * EXPERTS * slots, sent.elements
                dropped += ref.dropped
            else:
                load = ref.expert_load.clone()  # assignments per expert from this rank's tokens
                mine = TOKENS * TOP_K
                dist.all_reduce(load)
                received = int(load[rank * local : (rank + 1) * local].sum())
                # the counts; rows and weights out, rows back; the gradients of all three back
                expected = EXPERTS + 2 * (mine + received) * DIM + (mine + received)
                assert sent.elements == expected, (sent.elements, expected)
        dist.all_reduce(dropped)
        assert dropped > 0  # capacity mode really dropped assignments, on both sides of the exchange
        dist.barrier()  # neither rank tears its connections down while the other still uses them
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_exchange_on_two_ranks_equals_the_single_device_layer(tmp_path: Path) -> None:
    spawn(_exchange_worker, (str(tmp_path / "store"),), nprocs=2)


# ---------------------------------------------------------------------------------------------
# Training under torchrun against one process
# ---------------------------------------------------------------------------------------------

# capacity_factor = n_experts / top_k: every expert has a slot for every token, so the one-process
# run (whose capacity counts the whole batch) and the ranks (each their share) drop nothing alike.
MODES = {
    "capacity": ["model.moe_dispatch=capacity", "model.capacity_factor=4"],
    "dropless": ["model.moe_dispatch=dropless"],
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Each mode's records on one process, global batch 4."""
    records = {}
    for mode, overrides in MODES.items():
        run_dir = tmp_path_factory.mktemp(f"one_{mode}")
        fit([*MOE, *overrides, "checkpoint.enabled=false"], run_dir)
        records[mode] = train_records(run_dir)
    return records


def _assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-5), (g, w)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), (g, w)


def _overrides(nproc: int, mode: str, *extra: str, ep: int = 2) -> list[str]:
    per_rank = f"data.batch_size={4 // nproc}"  # the one-process run's global batch of 4
    return [*MOE, *MODES[mode], f"parallel.dp_shard={nproc}", f"parallel.ep={ep}", per_rank, *extra]


# The ep=2 runs on 2 processes: capacity (saving at step 2), and dropless with compiled blocks
# (aot_eager: dynamo and autograd tracing without inductor's build time) compiled around the
# expert-parallel MoE layer and full activation checkpointing, which recomputes the exchange in backward.
COMPILED = ["compile.enabled=true", "compile.backend=aot_eager", "parallel.activation_checkpointing=full"]
two_ranks = shared_launch.declare(
    "two_ranks",
    2,
    {
        "capacity": _overrides(2, "capacity", "checkpoint.every=2"),
        "dropless_compiled": _overrides(2, "dropless", "checkpoint.enabled=false", *COMPILED),
    },
)
# dp_shard=4 with ep=2 and ep=4 (capacity).
four_ranks = shared_launch.declare(
    "four_ranks",
    4,
    {f"ep{ep}": _overrides(4, "capacity", "checkpoint.enabled=false", ep=ep) for ep in (2, 4)},
)


@pytest.mark.slow
def test_ep2_capacity_matches_one_process_and_its_checkpoint_resumes_at_ep1(
    one_process, two_ranks, tmp_path: Path
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    want = one_process["capacity"]
    _assert_same_steps(train_records(two_ranks["capacity"]), want)

    saved = two_ranks["capacity"] / "checkpoints" / "step_0000002"
    metadata = FileSystemReader(saved).read_metadata().state_dict_metadata
    for layer in (0, 1):  # the sparse blocks: weights and Adam moments whole, not one rank's experts
        for key in (
            f"model.layers.{layer}.mlp.experts.gate_up_proj",
            f"optim.layers.{layer}.mlp.experts.gate_up_proj.exp_avg",
        ):
            assert tuple(metadata[key].size) == (8, 64, 128), (key, metadata[key].size)

    fit([*MOE, *MODES["capacity"], f"checkpoint.resume={saved}"], tmp_path / "ep1")
    resumed = train_records(tmp_path / "ep1")
    _assert_same_steps(resumed, want[2:])


@pytest.mark.slow
def test_ep2_dropless_compiled_and_checkpointed_matches_one_process(one_process, two_ranks) -> None:
    _assert_same_steps(train_records(two_ranks["dropless_compiled"]), one_process["dropless"])
    # The expert weights' gradient norm reduces over (efsdp, ep) in one all_reduce: no DTensor
    # warning on every rank about two sequential ones that may round differently.
    for name in ("capacity", "dropless_compiled"):
        stderr = (two_ranks[name] / "stderr.txt").read_text()
        assert "sequential all_reduce" not in stderr, (name, stderr[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4])
def test_ep_over_four_dp_shard_ranks_matches_one_process(one_process, four_ranks, ep: int) -> None:
    # ep=2: dp_shard=4 as (efsdp=2) x (ep=2), each rank's experts also FSDP-sharded over two ranks;
    # ep=4: two of the eight experts on each rank, exchanged among all four.
    _assert_same_steps(train_records(four_ranks[f"ep{ep}"]), one_process["capacity"])
