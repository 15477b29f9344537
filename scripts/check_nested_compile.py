"""Does hierarchical compilation (``torch.compiler.nested_compile_region``) give correct gradients here?

``compile.granularity=nested`` compiles the whole model with each transformer block a nested
compile region: one block traced and compiled once and reused per layer, so the first step stays
near per-block compilation's while steps run like the whole model's. On torch 2.13 (CPU, inductor)
the reused regions' gradients came out wrong unless inductor's buffer reuse is off, which is what
portatrain does for that graph. This script checks, on the debug Llama and one random batch, the
parameter gradients of five variants against eager:

- ``whole``: ``model.compile()``, no regions (the control);
- ``nested``: ``TransformerBlock.forward`` marked as a nested region, ``model.compile()``;
- ``nested, allow_buffer_reuse=False``: the same with inductor's buffer reuse off;
- ``nested, aot_eager``: the regions traced but not compiled by inductor;
- ``portatrain granularity=nested``: what the Trainer does (``portatrain.compile.nested_region`` on
  each block, then ``compile_model``).

    OMP_NUM_THREADS=1 python scripts/check_nested_compile.py

Not the bug pytorch/pytorch#193960 fixes (subgraph lowerings inheriting the outer graph's
donated-buffer indices): patching that fix into torch 2.13 left the gradients as wrong. Marking each
block instance's bound ``forward`` (rather than the class) lost the blocks' gradients altogether.
Run this on a new torch: once ``nested`` reads ok, the buffer-reuse workaround can go.
"""

from __future__ import annotations

import copy

import torch
import torch._dynamo

from portatrain.accelerators.cpu import CPUAccelerator
from portatrain.compile import compile_model, nested_region
from portatrain.config import CompileConfig
from portatrain.models.llama import model as llama


def gradients(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(tokens).pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def main() -> None:
    torch.manual_seed(0)
    reference = llama.Llama(llama.LLAMA3_FLAVORS["debug"])
    reference.init_weights()
    tokens = torch.randint(0, reference.args.vocab_size, (2, 64))
    expected = gradients(reference, tokens)
    print(f"torch {torch.__version__}; max |grad - eager grad| over {len(expected)} parameters:")
    plain_forward = llama.TransformerBlock.forward
    variants = [
        ("whole", False, "inductor", {}),
        ("nested", True, "inductor", {}),
        ("nested, allow_buffer_reuse=False", True, "inductor", {"allow_buffer_reuse": False}),
        ("nested, aot_eager", True, "aot_eager", {}),
        ("portatrain granularity=nested", None, "inductor", {}),
    ]
    for name, nested, backend, options in variants:
        torch._dynamo.reset()
        model = copy.deepcopy(reference)
        if nested is None:  # portatrain's own path
            for block in model.layers.values():
                nested_region(block)
            compile_model(model, CompileConfig(enabled=True), CPUAccelerator(), "nested")
        else:
            llama.TransformerBlock.forward = (
                torch.compiler.nested_compile_region(plain_forward) if nested else plain_forward
            )
            model.compile(backend=backend, fullgraph=True, **({"options": options} if options else {}))
        try:
            got = gradients(model, tokens)
        finally:
            llama.TransformerBlock.forward = plain_forward
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        scale = max(v.abs().max().item() for v in expected.values())
        verdict = "ok" if worst <= 1e-4 * scale else "WRONG"
        print(f"  {name:<36} {worst:.3e}  (largest gradient {scale:.3e})  {verdict}")


if __name__ == "__main__":
    main()
