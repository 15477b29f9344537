"""LoRA: low-rank adapters on a model's linear layers, and their files in PEFT's format.

Hu et al. 2021 (https://arxiv.org/abs/2106.09685): a frozen linear layer ``W`` gains a trainable
``(alpha / r) * B @ A`` (``A`` is ``[r, in]``, ``B`` is ``[out, r]``, ``B`` starts at zero, so step 0
is the base model). What this file does:

* :func:`lora_problems` -- ``finetune.lora``'s problems, the patterns checked against the model's own
  module names (built on meta, nothing allocated), for ``portatrain.validate``;
* :func:`apply_lora` -- freeze every weight and turn each matched ``nn.Linear`` into a
  :class:`LoRALinear` *in place* (its class is swapped and two small linears are added), so the
  hooks tensor parallel installed on it, its ``weight`` and every state-dict key stay as they were;
  the adapters' keys are ``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight``, PEFT's names;
* :func:`init_lora` -- PEFT's initialization (``A`` Kaiming-uniform, ``B`` zero);
* :func:`adapters_disabled` -- the base model, adapters off (DPO's reference);
* :func:`lora_flops_per_token` -- the training FLOPs a LoRA step executes (MFU): the frozen base's
  forward and input gradients, the adapters' full cost;
* :func:`save_peft_adapter` / :func:`merge_lora` -- ``adapter_config.json`` +
  ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained`` loads onto the exported base
  model, or the merged weights ``W + (alpha / r) B A`` (``portatrain export merge_lora=true``).

It runs inside the parallel plan, after tensor parallel and before activation checkpointing,
compile and FSDP2 (the ``adapt`` step of ``portatrain.models.common.parallelize``): a layer whose
weight tensor parallel split by output rows (``Shard(0)``: q/k/v, gate/up) gets a replicated ``A``
and a ``B`` split the same way; one split by input columns (``Shard(1)``: o, down) gets an ``A``
split by columns and a replicated ``B`` -- Megatron's layout for LoRA, so the adapter adds no
collective of its own. FSDP2 then shards the adapters with the frozen weights of their block; the
optimizer sees only the adapters (``portatrain.optim`` skips frozen parameters), so the base costs
neither gradients nor optimizer state.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from portatrain.config import LoraConfig

ADAPTER_PARTS = ("lora_A", "lora_B")
"""Names of an adapted layer's two matrices (PEFT's, so the saved keys are PEFT's)."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a Hugging Face module path in ``adapter_model.safetensors``."""


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key is an adapter's (``...q_proj.lora_A.weight``), not the base model's."""
    return any(f".{part}." in key for part in ADAPTER_PARTS)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank adapter; made by :func:`apply_lora` from an existing layer."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    scaling: float
    lora_enabled: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def target_modules(model: nn.Module, patterns: list[str]) -> dict[str, list[str]]:
    """``pattern -> names of the linear layers it matches`` among the model's transformer blocks.

    A pattern without a dot matches a layer's own name (``q_proj``), one with dots the whole path
    (``layers.*.mlp.*``), both with ``fnmatch``. Only ``nn.Linear`` layers inside ``layers`` are
    candidates: not the output head (the chunked loss reads its matrix directly) nor a mixture of
    experts' routed experts (stacked ``[n_experts, ...]`` weights, not linear layers).
    """
    linears = [
        name
        for name, module in _named_modules(model)
        if name.startswith("layers.") and type(module) in (nn.Linear, LoRALinear)
    ]
    found = {}
    for pattern in patterns:
        if "." in pattern:
            found[pattern] = [n for n in linears if fnmatch.fnmatchcase(n, pattern)]
        else:
            found[pattern] = [n for n in linears if fnmatch.fnmatchcase(n.rsplit(".", 1)[-1], pattern)]
    return found


def lora_problems(cfg: LoraConfig, model: nn.Module | None) -> list[str]:
    """``finetune.lora``'s problems, each with its fix; ``model`` (on meta) checks the target patterns."""
    problems = []
    if cfg.rank <= 0:
        problems.append(f"finetune.lora.rank={cfg.rank} must be positive (e.g. 8 or 16)")
    if cfg.alpha <= 0:
        problems.append(f"finetune.lora.alpha={cfg.alpha} must be positive (the scale is alpha / rank)")
    if not 0.0 <= cfg.dropout < 1.0:
        problems.append(f"finetune.lora.dropout={cfg.dropout} must be in [0, 1)")
    if not list(cfg.targets):
        problems.append("finetune.lora.targets is empty; name the layers to adapt, e.g. [q_proj,v_proj]")
    if model is None or not list(cfg.targets):
        return problems
    found = target_modules(model, list(cfg.targets))
    for pattern, names in found.items():
        if names:
            continue
        hint = ""
        if "expert" in pattern:
            hint = " (a mixture of experts' routed experts are stacked weights, not linear layers: LoRA does not adapt them)"
        problems.append(
            f"finetune.lora.targets: {pattern!r} matches no linear layer of this model{hint}; its layers "
            f"are named {', '.join(_layer_names(model))} (a pattern with dots matches the whole path, "
            "e.g. layers.*.self_attn.q_proj)"
        )
    return problems


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Freeze every parameter and add an adapter to each linear layer ``cfg.targets`` matches.

    In place, on any device (meta included) and after tensor parallel; returns the adapted layers'
    names. Initialize the adapters afterwards with :func:`init_lora` (after ``to_empty``).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    names = sorted({n for ns in target_modules(model, list(cfg.targets)).values() for n in ns})
    if not names:
        raise ValueError(f"finetune.lora.targets={list(cfg.targets)} match no linear layer of the model")
    for param in model.parameters():
        param.requires_grad_(False)
    modules = dict(_named_modules(model))
    for name in names:
        layer = modules[name]
        weight = layer.weight
        out_features, in_features = weight.shape
        factory = {"device": weight.device, "dtype": weight.dtype}
        lora_A = nn.Linear(in_features, cfg.rank, bias=False, **factory)
        lora_B = nn.Linear(cfg.rank, out_features, bias=False, **factory)
        if isinstance(weight, DTensor):  # tensor parallel: split as Megatron's LoRA does
            mesh, (placement,) = weight.device_mesh, weight.placements
            row_split = isinstance(placement, Shard) and placement.dim == 0
            a_place = Replicate() if row_split else placement
            b_place = placement if row_split else Replicate()
            lora_A.weight = nn.Parameter(distribute_tensor(lora_A.weight, mesh, [a_place]))
            lora_B.weight = nn.Parameter(distribute_tensor(lora_B.weight, mesh, [b_place]))
        layer.__class__ = LoRALinear
        layer.lora_A, layer.lora_B = lora_A, lora_B
        layer.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        layer.scaling = cfg.alpha / cfg.rank
        layer.lora_enabled = True
    return names


@torch.no_grad()
def init_lora(model: nn.Module) -> None:
    """PEFT's default initialization: ``A`` Kaiming-uniform (``a=sqrt(5)``, ``nn.Linear``'s), ``B`` zero."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            nn.init.kaiming_uniform_(module.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(module.lora_B.weight)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter switched off inside the block (free: no copy of any weight)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_enabled = True


def lora_state(cfg: LoraConfig, modules: list[str]) -> dict[str, Any]:
    """What a checkpoint records of its adapters (``trainer_state.json``), for export."""
    return {
        "rank": int(cfg.rank),
        "alpha": float(cfg.alpha),
        "dropout": float(cfg.dropout),
        "modules": list(modules),
    }


def adapter_params(model: nn.Module, modules: list[str]) -> int:
    """Parameters of the adapters on ``modules`` (global sizes: a tensor-parallel ``DTensor``'s
    ``numel`` is its whole tensor's)."""
    layers = dict(_named_modules(model))
    return sum(getattr(layers[m], part).weight.numel() for m in modules for part in ADAPTER_PARTS)


def lora_flops_per_token(flops_per_token: Callable[[int], int], adapters: int) -> Callable[[int], int]:
    """Training FLOPs per token of a LoRA run, as executed, from full fine-tuning's ``flops_per_token``.

    Full fine-tuning costs ``6 N`` per token for the weight matmuls: 2 forward, 2 for the inputs'
    gradients and 2 for the weights' (PaLM's convention, ``DecoderArgs.flops_per_token``). A frozen
    weight gets no gradient, so autograd skips its weight-gradient matmul: ``4 N``. The inputs'
    gradients still run through every frozen layer, as the adapters below them need them (a little
    less in fact: the first block's inputs come from the frozen embedding and need none). The
    adapters (``adapters`` parameters, ``A`` and ``B``) train: ``6`` each. Attention's two matmuls
    (no weights) cost what they cost in full fine-tuning. ``flops_per_token(0)`` is the ``6 N``
    term alone: attention's term grows with the row length and is 0 at 0.
    """

    def executed(seq_len: int) -> int:
        frozen_weight_grads = flops_per_token(0) // 3  # 2 N of the 6 N
        return flops_per_token(seq_len) - frozen_weight_grads + 6 * adapters

    return executed


def adapter_keys(state: Mapping[str, Any]) -> list[str]:
    """The state-dict keys of the adapters a checkpoint's ``lora`` record lists."""
    return [f"{m}.{part}.weight" for m in state["modules"] for part in ADAPTER_PARTS]


def merge_lora(
    tensors: dict[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], state: Mapping[str, Any]
) -> None:
    """``W += (alpha / r) * B @ A`` for every adapted layer whose ``weight`` is in ``tensors`` (fp32)."""
    scaling = float(state["alpha"]) / int(state["rank"])
    for module in state["modules"]:
        key = f"{module}.weight"
        if key in tensors:
            a, b = adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
            merged = tensors[key].float() + scaling * (b.float() @ a.float())
            tensors[key] = merged.to(tensors[key].dtype)


def save_peft_adapter(
    out: Path,
    adapters: Mapping[str, torch.Tensor],
    state: Mapping[str, Any],
    *,
    to_hf: Any,
    base_model: str | None = None,
) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's LoRA format.

    Keys are ``base_model.model.<HF module path>.lora_A.weight`` (PEFT drops the adapter name when it
    saves); ``target_modules`` lists the full HF paths of the adapted layers, which PEFT matches
    exactly (``key == target or key.endswith("." + target)``).
    """
    from safetensors.torch import save_file

    hf = to_hf(dict(adapters))  # our names -> HF's, tensors untouched
    modules = sorted(to_hf({f"{m}.weight": None for m in state["modules"]}))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(state["rank"]),
        "lora_alpha": float(state["alpha"]),
        "lora_dropout": float(state["dropout"]),
        "target_modules": [m.removesuffix(".weight") for m in modules],
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    out.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + k: v.contiguous() for k, v in hf.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``named_modules`` with the names a state dict uses (wrappers' prefixes removed)."""
    for name, module in model.named_modules():
        yield name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""), module


def _layer_names(model: nn.Module) -> list[str]:
    """The distinct last names of the linear layers inside the blocks (what plain patterns match)."""
    names = {
        n.rsplit(".", 1)[-1]
        for n, m in _named_modules(model)
        if n.startswith("layers.") and isinstance(m, nn.Linear)
    }
    return sorted(names)
