"""The shared mixture-of-experts layer against a dense SwiGLU of the same active FLOPs and against
transformers' ``Qwen3MoeSparseMoeBlock``: forward + backward time, measured side by side.

At Qwen 3 MoE's expert shape scaled down to a CPU (128 experts, top-8, expert width 3/8 of the
hidden size as 30B-A3B's 768 of 2048), four runners take turns on the same tokens (the order
rotates each round, so load from other processes hits all alike):

- ``dense``: a SwiGLU ``top_k * expert_width`` wide -- the same matmul FLOPs per token, no routing;
- ``ours-dropless``: ``portatrain.models.common.moe.MoE`` with dropless dispatch (grouped matmul);
- ``ours-capacity``: the same layer with capacity dispatch (``capacity_factor`` 1.25, static shapes);
- ``hf-eager``, ``hf-grouped_mm``: transformers' ``Qwen3MoeSparseMoeBlock`` with the same weights, its
  default per-expert loop and its ``experts_implementation="grouped_mm"`` (``torch._grouped_mm``, as
  ours); skipped without transformers.

Printed: the median time of each, ``dense / ours`` (the limit is 1.0: routing can only add work)
and ``hf-* / ours``. A second shape (32 experts, top-4) shows the trend with fewer experts.

    OMP_NUM_THREADS=1 python scripts/bench_moe.py
    OMP_NUM_THREADS=1 python scripts/bench_moe.py --dim 256 --tokens 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from portatrain.models.common.layers import FeedForward
from portatrain.models.common.moe import MoE

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
        module(x).square().mean().backward()

    return run


def measure(dim: int, width: int, experts: int, top_k: int, tokens: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    moe = MoE(dim, width, experts, top_k, norm_topk_prob=True)
    moe.init_weights(0.02, 0.02)
    capacity = MoE(dim, width, experts, top_k, norm_topk_prob=True)
    capacity.load_state_dict(moe.state_dict())
    capacity.dispatch = "capacity"
    dense = FeedForward(dim, top_k * width)
    dense.init_weights(0.02, 0.02)
    x = torch.randn(tokens, dim)
    runners = {"dense": _step(dense, x), "ours-dropless": _step(moe, x), "ours-capacity": _step(capacity, x)}
    for impl in HF_IMPLEMENTATIONS:
        hf = _hf_block(moe, dim, width, experts, top_k, impl)
        if hf is not None:
            with torch.no_grad():  # same weights, same routing: same output
                assert torch.allclose(hf(x[None])[0], moe(x), atol=1e-5)
            runners[f"hf-{impl}"] = _step(hf, x[None])
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for run in runners.values():  # warm-up
        run()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=512, help="hidden size (expert width: 3/8 of it)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), fp32, {args.tokens} tokens")
    for experts, top_k in ((128, 8), (32, 4)):
        width = args.dim * 3 // 8
        t = measure(args.dim, width, experts, top_k, args.tokens, args.rounds)
        print(
            f"\n{experts} experts, top-{top_k}, dim {args.dim}, expert width {width} (dense width {top_k * width})"
        )
        for name, seconds in t.items():
            print(f"  {name:<14} {seconds * 1e3:8.1f} ms")
        for ours in ("ours-dropless", "ours-capacity"):
            line = f"  dense / {ours}: {t['dense'] / t[ours]:.2f}"
            for hf in (name for name in t if name.startswith("hf-")):
                line += f"   {hf} / {ours}: {t[hf] / t[ours]:.2f}"
            print(line)


if __name__ == "__main__":
    main()
