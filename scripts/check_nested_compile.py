"""Does hierarchical compilation (``torch.compiler.nested_compile_region``) give correct gradients here?

Why portatrain does not offer it: compiling the whole model with each transformer block marked as
a nested compile region would keep per-block compilation's cold start (one block traced and compiled
once, reused per layer) with whole-model steps. On torch 2.13 (CPU, inductor) the reused regions'
gradients came out wrong. This script checks, on the debug Llama and one random batch, the
parameter gradients of four variants against eager:

- ``whole``: ``model.compile()``, no regions (the control);
- ``nested``: ``TransformerBlock.forward`` marked as a nested region, ``model.compile()``;
- ``nested, allow_buffer_reuse=False``: the same with inductor's buffer reuse off (a workaround);
- ``nested, aot_eager``: the regions traced but not compiled by inductor.

    OMP_NUM_THREADS=1 python scripts/check_nested_compile.py

The workaround row is correct here, but is not adopted either: it turns off buffer reuse for the
whole graph (more memory), and marking each block instance's ``forward`` -- needed so the model
class itself is left alone -- lost the blocks' parameter gradients in a separate try. Not the bug
pytorch/pytorch#193960 fixes (subgraph lowerings inheriting the outer graph's donated-buffer
indices): patching that fix into torch 2.13 left the gradients as wrong. Run this again on a newer
torch before offering nested regions.
"""

from __future__ import annotations

import copy

import torch
import torch._dynamo

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
    ]
    for name, nested, backend, options in variants:
        torch._dynamo.reset()
        llama.TransformerBlock.forward = (
            torch.compiler.nested_compile_region(plain_forward) if nested else plain_forward
        )
        model = copy.deepcopy(reference)
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
