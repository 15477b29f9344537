"""The shared mixture-of-experts layer against a dense SwiGLU of the same active FLOPs and against
transformers' ``Qwen3MoeSparseMoeBlock``: forward + backward time, measured side by side.

At Qwen 3 MoE's expert shape scaled down to a CPU (128 experts, top-8, expert width 3/8 of the
hidden size as 30B-A3B's 768 of 2048), the runners take turns on the same tokens (the order
rotates each round, so load from other processes hits all alike):

- ``dense``: a SwiGLU ``top_k * expert_width`` wide -- the same matmul FLOPs per token, no routing;
- ``ours-dropless``: ``portatrain.models.common.moe.MoE`` with dropless dispatch (grouped matmul);
- ``ours-capacity``: the same layer with capacity dispatch (``capacity_factor`` 1.25, static shapes);
- ``ours-matmuls``: only the six grouped matmuls of ``ours-dropless``'s forward and backward, on its
  routing (inputs made beforehand, outputs -- the weights' gradients among them -- allocated as in
  the layer): what any dropless layer at these shapes must spend, so ``dense / ours-matmuls``
  bounds ``dense / ours``;
- ``hf-eager``, ``hf-grouped_mm``: transformers' ``Qwen3MoeSparseMoeBlock`` with the same weights, its
  default per-expert loop and its ``experts_implementation="grouped_mm"`` (``torch._grouped_mm``, as
  ours); skipped without transformers.

The block's input needs its gradient (as inside a model), so every runner computes it. Each step
is timed twice: by the process's CPU time (one thread: the time it held a core, which other
processes' load does not add to) and by the wall clock; the ratios use CPU time, medians of the
rounds. Printed: the medians, ``dense / ours`` (the limit is 1.0: routing can only add work) and
``hf-* / ours``, and the load average before and after. A second shape (32 experts, top-4) shows the
trend with fewer experts.

    OMP_NUM_THREADS=1 python scripts/bench_moe.py
    OMP_NUM_THREADS=1 python scripts/bench_moe.py --dim 256 --tokens 1024 --rounds 5 --hf grouped_mm
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from portatrain.accelerators import Accelerator
from portatrain.accelerators.cpu import CPUAccelerator
from portatrain.models.common.layers import FeedForward
from portatrain.models.common.moe import MoE, configure_moe, grouped_mm, grouped_outer

HF_IMPLEMENTATIONS = ("eager", "grouped_mm")


def _hf_block(moe: MoE, dim: int, width: int, experts: int, top_k: int, impl: str) -> torch.nn.Module | None:
    try:
        import transformers
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError:
        return None
    config = transformers.Qwen3MoeConfig(
        hidden_size=dim,
        moe_intermediate_size=width,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        experts_implementation=impl,
    )
    block = Qwen3MoeSparseMoeBlock(config)
    block.load_state_dict({k: v for k, v in moe.state_dict().items()}, strict=False)
    return block


def _step(module: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).square().mean().backward()

    return run


def _matmuls(moe: MoE, dense: FeedForward, x: torch.Tensor) -> dict[str, tuple[Callable, Callable]]:
    """The six grouped matmuls of ``moe``'s dropless forward and backward on ``x``'s routing, each
    with the dense layer's matmul of the same FLOPs: ``{name: (grouped, dense)}``. Inputs are made
    here; outputs are allocated per call, as in the layers."""
    with torch.no_grad():
        _, experts, _ = moe.gate(x)
        flat = experts.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=moe.n_experts), dim=0, dtype=torch.int32)
        rows = x[torch.arange(x.shape[0]).repeat(moe.top_k)[order]]
        dense_gate_up = torch.cat([dense.gate_proj.weight, dense.up_proj.weight])
        dense_down = dense.down_proj.weight.detach()
    gate_up_proj, down_proj = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()
    hidden = torch.randn(rows.shape[0], down_proj.shape[-1])
    grad_out, grad_gate_up = torch.randn_like(rows), torch.randn(rows.shape[0], gate_up_proj.shape[1])
    dense_hidden = torch.randn(x.shape[0], dense_down.shape[1])
    dense_grad_out, dense_grad_gate_up = torch.randn_like(x), torch.randn(x.shape[0], dense_gate_up.shape[0])
    native = rows.dtype in moe.experts.grouped_mm_dtypes  # torch._grouped_mm where the adapter says it runs
    return {
        "gate_up forward": (
            lambda: grouped_mm(rows, gate_up_proj.transpose(1, 2), offs, native),
            lambda: x @ dense_gate_up.t(),
        ),
        "down forward": (
            lambda: grouped_mm(hidden, down_proj.transpose(1, 2), offs, native),
            lambda: dense_hidden @ dense_down.t(),
        ),
        "down input grad": (
            lambda: grouped_mm(grad_out, down_proj, offs, native),
            lambda: dense_grad_out @ dense_down,
        ),
        "gate_up input grad": (
            lambda: grouped_mm(grad_gate_up, gate_up_proj, offs, native),
            lambda: dense_grad_gate_up @ dense_gate_up,
        ),
        "down weight grad": (
            lambda: grouped_outer(grad_out, hidden, offs, native),
            lambda: dense_grad_out.t() @ dense_hidden,
        ),
        "gate_up weight grad": (
            lambda: grouped_outer(grad_gate_up, rows, offs, native),
            lambda: dense_grad_gate_up.t() @ x,
        ),
    }


def _all(calls: list[Callable]) -> Callable[[], None]:
    def run() -> None:
        for call in calls:
            call()

    return run


def measure(
    dim: int,
    width: int,
    experts: int,
    top_k: int,
    tokens: int,
    rounds: int,
    hf: tuple[str, ...],
    breakdown: bool = False,
    accelerator: Accelerator | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, tuple[float, float]]:
    """``{runner: (median CPU seconds, median wall seconds)}`` of one forward + backward (with
    ``breakdown``, also each grouped matmul, ``grouped <name>``, and its dense one, ``dense <name>``).

    On ``accelerator`` (default the CPU) in ``dtype``: everything is made there (weights, tokens and
    routing in ``dtype``), and each timing waits for the device (``scripts/device_check.py`` runs it
    on a GPU in bf16, where the wall time is what counts)."""
    accelerator = accelerator or CPUAccelerator()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(accelerator.device):
            return _measure(dim, width, experts, top_k, tokens, rounds, hf, breakdown, accelerator)
    finally:
        torch.set_default_dtype(default_dtype)


def _measure(
    dim: int,
    width: int,
    experts: int,
    top_k: int,
    tokens: int,
    rounds: int,
    hf: tuple[str, ...],
    breakdown: bool,
    accelerator: Accelerator,
) -> dict[str, tuple[float, float]]:
    torch.manual_seed(0)
    moe = MoE(dim, width, experts, top_k, norm_topk_prob=True)
    moe.init_weights(0.02, 0.02)
    capacity = MoE(dim, width, experts, top_k, norm_topk_prob=True)
    capacity.load_state_dict(moe.state_dict())
    for layer, dispatch in ((moe, "dropless"), (capacity, "capacity")):
        # The trainer's settings: the adapter says whether torch._grouped_mm runs here.
        configure_moe(
            layer,
            dispatch=dispatch,
            capacity_factor=1.25,
            aux_loss_scale=1.0,
            supports_grouped_mm=accelerator.supports_grouped_mm,
        )
    dense = FeedForward(dim, top_k * width)
    dense.init_weights(0.02, 0.02)
    x = torch.randn(tokens, dim, requires_grad=True)
    runners = {
        "dense": _step(dense, x),
        "ours-dropless": _step(moe, x),
        "ours-capacity": _step(capacity, x),
    }
    matmuls = _matmuls(moe, dense, x.detach())
    runners["ours-matmuls"] = _all([grouped for grouped, _ in matmuls.values()])
    if breakdown:
        for name, (grouped, dense_mm) in matmuls.items():
            runners[f"grouped {name}"], runners[f"dense {name}"] = grouped, dense_mm
    for impl in hf:
        block = _hf_block(moe, dim, width, experts, top_k, impl)
        if block is not None:
            with torch.no_grad():  # same weights, same routing: same output
                assert torch.allclose(block(x[None])[0], moe(x), atol=1e-5)
            runners[f"hf-{impl}"] = _step(block, x[None])
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    wall: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for run in runners.values():  # warm-up
        run()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            accelerator.synchronize()  # a device's queued work is not this runner's
            start_cpu, start_wall = time.process_time(), time.perf_counter()
            runners[name]()
            accelerator.synchronize()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start_wall)
    return {name: (statistics.median(cpu[name]), statistics.median(wall[name])) for name in runners}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512, help="hidden size (expert width: 3/8 of it)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--hf",
        default=",".join(HF_IMPLEMENTATIONS),
        help="transformers' expert implementations to time, comma-separated ('' for none)",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="also time each grouped matmul beside the dense one"
    )
    args = parser.parse_args()
    hf = tuple(name for name in args.hf.split(",") if name)
    for name in hf:
        if name not in HF_IMPLEMENTATIONS:
            parser.error(f"--hf {name!r}: choose from {', '.join(HF_IMPLEMENTATIONS)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32, {args.tokens} tokens")
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    for experts, top_k in ((128, 8), (32, 4)):
        width = args.dim * 3 // 8
        t = measure(args.dim, width, experts, top_k, args.tokens, args.rounds, hf, args.breakdown)
        print(
            f"\n{experts} experts, top-{top_k}, dim {args.dim}, expert width {width} (dense width {top_k * width})"
        )
        print(f"  {'':<14} {'CPU':>8}    {'wall':>8}")
        for name, (cpu, wall) in t.items():
            if not name.startswith(("grouped ", "dense ")):
                print(f"  {name:<14} {cpu * 1e3:8.1f} ms {wall * 1e3:8.1f} ms")
        for name in (name.removeprefix("grouped ") for name in t if name.startswith("grouped ")):
            grouped, dense_mm = t[f"grouped {name}"][0], t[f"dense {name}"][0]
            print(
                f"  {name:<20} grouped {grouped * 1e3:6.1f} ms, dense {dense_mm * 1e3:6.1f} ms: {dense_mm / grouped:.2f}"
            )
        dense = t["dense"][0]
        print(f"  dense / ours-matmuls: {dense / t['ours-matmuls'][0]:.2f} (the bound for dense / ours)")
        for ours in ("ours-dropless", "ours-capacity"):
            line = f"  dense / {ours}: {dense / t[ours][0]:.2f}"
            for name in (name for name in t if name.startswith("hf-")):
                line += f"   {name} / {ours}: {t[name][0] / t[ours][0]:.2f}"
            print(line)
    print("load average after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
