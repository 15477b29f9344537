"""``quantize.linear``: the transformer blocks' linear layers multiply in FP8 or MXFP8, through torchao.

Recipes (:data:`RECIPES`), each torchao's (pytorch/ao, tested with torchao 0.18):

* ``float8_tensorwise`` -- ``torchao.float8.Float8Linear``: input, weight and output gradient cast to
  FP8 (e4m3) with one dynamic scale per tensor. With FSDP2, each weight is cast to FP8 *before* its
  all-gather (``enable_fsdp_float8_all_gather``: half bf16's bytes on the wire), and the scales of all
  of them are computed in one all-reduce after each optimizer step
  (``precompute_float8_dynamic_scale_for_fsdp``, this converter's ``post_optimizer_step``), as in
  pytorch/torchtitan ``docs/float8.md``;
* ``float8_rowwise`` -- the same layer with a scale per row (``Float8LinearConfig.from_recipe_name
  ("rowwise")``, scales rounded to powers of two): closer to bf16, weights all-gathered in bf16;
* ``mxfp8`` -- torchao's ``MXFP8Linear`` (``torchao.prototype.moe_training.mxfp8_linear``, a prototype
  there): e4m3 elements with a power-of-two (e8m0) scale per 32 consecutive elements (OCP
  Microscaling Formats v1.0), scales rounded up (RCEIL).

**What is converted** (:func:`select_linears`): the ``nn.Linear`` layers inside the transformer blocks
(``model.layers``) whose two dimensions are multiples of 16 (32 for MXFP8: the tensor cores' tile,
and MXFP8's scale blocks), except those of the last ``quantize.skip_last_blocks`` blocks. The output
head, and anything else outside the blocks, stays in high precision: the logits are where the loss
is most sensitive, and torchtitan's configs leave the head out too (``filter_fqns=["lm_head"]`` in
``torchtitan/models/llama3/config_registry.py``; its NVFP4 notes, ``components/quantization/nvfp4.md``,
keep the last ~15% of the blocks in bf16 as well: ``quantize.skip_last_blocks``).
One log line says what was converted and what was kept.

**Mixture of experts.** The routed experts stay in high precision, and the run says so once. torchao
0.18 has low-precision grouped GEMMs (``torchao.prototype.moe_training``), but it reaches them by
wrapping the expert weights in a tensor subclass that intercepts ``torch._grouped_mm``, while this
project's experts multiply through a custom op (dropless: ``portatrain::grouped_mm``) or ``bmm``
(capacity): the wrapper would see neither and compute in high precision behind an FP8 label. The
router is no linear layer (kept); shared experts are (converted).

**Weights stay what they were.** Both layers keep an ordinary high-precision ``weight`` parameter
(under FSDP2's FP8 all-gather, a tensor subclass over the same storage) and cast at each matmul, so
parameter names, checkpoints, ``export`` and a resume with or without ``quantize.linear`` are those of
the unconverted model.

**Where it runs.** The accelerator adapter declares its formats (``Accelerator.low_precision_matmuls``):
``native`` runs; ``emulated`` (CPU: torch's CPU ``_scaled_mm`` and torchao's emulated MXFP8 round as
the GPU does, without its speed) runs and says so once; undeclared is refused before anything is
built. FSDP2, HSDP, context and expert parallel compose with it (the linears see fewer tokens or are
untouched); tensor parallel is refused (the families' plans do not use torchao's
``Float8ColwiseParallel``/``Float8RowwiseParallel`` styles), pipeline parallel too (untested), and
LoRA (its adapters replace the linear layer's forward).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from portatrain.config import Config
from portatrain.converters.base import Converter
from portatrain.errors import UserError

if TYPE_CHECKING:
    from portatrain.converters.base import BuildContext

logger = logging.getLogger(__name__)

RECIPES = ("none", "float8_tensorwise", "float8_rowwise", "mxfp8")
"""Allowed values of ``quantize.linear``."""
FORMATS = {"float8_tensorwise": "float8", "float8_rowwise": "float8", "mxfp8": "mxfp8"}
"""The matmul format of each recipe, as ``Accelerator.low_precision_matmuls`` names it."""
FORMAT_NAMES = {"float8": "FP8", "mxfp8": "MXFP8"}
MULTIPLE = {"float8": 16, "mxfp8": 32}
"""Every dimension of a converted matmul (a layer's two, and the tokens its weight gradient sums
over) is a multiple of this: FP8 tensor cores' alignment (``torch._scaled_mm``), MXFP8's scale block."""
TORCHAO = "torchao>=0.18"
"""The version tested (``pyproject.toml``: the ``fp8`` extra)."""


class QuantizeError(UserError):
    """``quantize.linear`` cannot run here; the message says why and what to set instead."""


def problems(cfg: Config) -> list[str]:
    """Every problem of the ``quantize`` section with the rest of ``cfg``, each with its fix."""
    from portatrain.data.loader import batch_shapes
    from portatrain.finetune import uses_lora
    from portatrain.models import model_args, model_problems

    q, recipe = cfg.quantize, cfg.quantize.linear
    if recipe not in RECIPES:
        return [f"quantize.linear={recipe!r} is not one of {', '.join(RECIPES)}"]
    found = []
    if q.skip_last_blocks < 0:
        found.append(f"quantize.skip_last_blocks={q.skip_last_blocks} must be >= 0 (0 converts every block)")
    if recipe == "none":
        return found
    if importlib.util.find_spec("torchao") is None:
        found.append(f"quantize.linear={recipe} needs torchao, which is not installed: {_install()}")
    if not model_problems(cfg.model):  # an invalid model is reported by the model stage
        n_layers = model_args(cfg.model).n_layers
        if q.skip_last_blocks >= n_layers:
            found.append(
                f"quantize.skip_last_blocks={q.skip_last_blocks} keeps all {n_layers} blocks in high "
                f"precision: nothing would be quantized; set it below {n_layers} or quantize.linear=none"
            )
    par = cfg.parallel
    if par.tp > 1:
        found.append(
            f"quantize.linear={recipe} with parallel.tp={par.tp}: the tensor-parallel plans shard plain "
            "linear layers, not torchao's FP8 ones (Float8ColwiseParallel is not wired in); set "
            "parallel.tp=1 (FSDP2 shards instead) or quantize.linear=none"
        )
    if par.pp > 1:
        found.append(
            f"quantize.linear={recipe} with parallel.pp={par.pp}: untested with pipeline stages; set "
            "parallel.pp=1 or quantize.linear=none"
        )
    if uses_lora(cfg.finetune):
        found.append(
            f"quantize.linear={recipe} with LoRA (finetune.method={cfg.finetune.method}): the adapters "
            "replace the linear layers' forward, and with it the low-precision matmul; set "
            "quantize.linear=none"
        )
    multiple = MULTIPLE[FORMATS[recipe]]
    try:
        shapes = batch_shapes(cfg.data)
    except ValueError:  # an invalid collator: the data stage reports it
        shapes = []
    for rows, length in shapes:
        tokens = rows * length // max(1, par.cp)
        if tokens % multiple:
            found.append(
                f"quantize.linear={recipe}: a micro-batch of {rows} x {length} positions"
                + (f" / cp={par.cp}" if par.cp > 1 else "")
                + f" = {tokens} tokens per rank, not a multiple of {multiple} (the weight gradient's "
                f"matmul runs over the tokens); make data.batch_size x the row length a multiple of {multiple}"
            )
    return found


def build(cfg: Config, context: BuildContext) -> Float8Linears | MXFP8Linears | None:
    """The converter of ``cfg.quantize`` for this run, None for ``quantize.linear=none``; refuses
    (:class:`QuantizeError`) a device that declares no such matmuls, or a missing torchao."""
    recipe = cfg.quantize.linear
    if recipe == "none":
        return None
    accelerator = context.accelerator
    declared = accelerator.low_precision_matmuls()
    how = declared.get(FORMATS[recipe])
    if how is None:
        usable = [r for r in RECIPES[1:] if FORMATS[r] in declared]
        raise QuantizeError(
            f"quantize.linear={recipe}: device {accelerator.name} ({accelerator.device_name()}) declares "
            f"no {FORMAT_NAMES[FORMATS[recipe]]} matmuls (declared: {', '.join(declared) or 'none'}); set "
            f"quantize.linear={' or '.join([*usable, 'none'])}"
        )
    import_torchao()
    settings = {
        "skip_last_blocks": int(cfg.quantize.skip_last_blocks),
        "emulated_on": accelerator.name if how == "emulated" else None,
    }
    if FORMATS[recipe] == "mxfp8":
        return MXFP8Linears(**settings)
    all_gather = (
        recipe == "float8_tensorwise"
        and bool(cfg.quantize.fsdp_float8_all_gather)
        and context.parallel_dims.fsdp_enabled
    )
    if recipe == "float8_rowwise" and cfg.compile.enabled:
        # torchtitan sets this for rowwise under compile (pytorch/pytorch#150859): inductor's fused
        # casts otherwise round differently from eager's.
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    return Float8Linears(recipe, all_gather=all_gather, **settings)


def import_torchao() -> Any:
    """torchao, or one line saying how to install it (the ``fp8`` extra, not a core dependency)."""
    try:
        with _quiet_imports():
            import torchao
    except ImportError as exc:
        raise QuantizeError(f"quantize.linear needs torchao ({exc}): {_install()}") from exc
    return torchao


@contextlib.contextmanager
def _quiet_imports() -> Iterator[None]:
    """Drop the import-time warnings of torchao that say nothing to a user: on a CPU-only torch, one
    per CUDA kernel library it cannot load (none would run here); and, from its prototype modules,
    torch 2.13's note that registering an enum with pytree is no longer needed."""
    quiet = [logging.getLogger("torch.utils._pytree")]
    if torch.version.cuda is None and torch.version.hip is None:
        quiet.append(logging.getLogger("torchao"))
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)


def _install() -> str:
    return f"pip install 'portatrain[fp8]' (or '{TORCHAO}')"


def select_linears(
    model: nn.Module, multiple: int, skip_last_blocks: int
) -> tuple[set[str], dict[str, list[str]]]:
    """The linear layers to convert, by name, and those kept in high precision by reason.

    Candidates are the ``nn.Linear`` layers of the blocks (``model.layers``); one is kept when it is
    in the last ``skip_last_blocks`` blocks or has a dimension that is not a multiple of ``multiple``.
    Every other linear layer (the output head) is kept as outside the blocks."""
    blocks = getattr(model, "layers", None)
    names = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else []
    last = set(names[len(names) - skip_last_blocks :]) if skip_last_blocks else set()
    chosen: set[str] = set()
    kept: dict[str, list[str]] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parts = fqn.split(".")
        if parts[0] != "layers" or len(parts) < 2:
            reason = "outside the blocks"
        elif parts[1] in last:
            reason = f"in the last {skip_last_blocks} block(s)"
        elif module.in_features % multiple or module.out_features % multiple:
            reason = f"dimensions not multiples of {multiple}"
        else:
            chosen.add(fqn)
            continue
        kept.setdefault(reason, []).append(fqn)
    return chosen, kept


class _LowPrecisionLinears(Converter):
    """What the two converters share: the selection, the one log line, no post-step work by default."""

    format = ""
    recipe = ""

    def __init__(self, *, skip_last_blocks: int, emulated_on: str | None) -> None:
        self.skip_last_blocks = skip_last_blocks
        self.emulated_on = emulated_on

    def select(self, model: nn.Module) -> set[str]:
        chosen, kept = select_linears(model, MULTIPLE[self.format], self.skip_last_blocks)
        if os.environ.get("RANK", "0") == "0":  # once per job
            self._announce(model, chosen, kept)
        return chosen

    def _announce(self, model: nn.Module, chosen: set[str], kept: dict[str, list[str]]) -> None:
        from portatrain.models.common.moe import MoE

        text = FORMAT_NAMES[self.format]
        kept_text = "; ".join(f"{len(v)} {reason} ({_some(v)})" for reason, v in kept.items())
        line = f"quantize.linear={self.recipe}: {len(chosen)} linear layers multiply in {text}"
        line += f"; kept in high precision: {kept_text}" if kept else ""
        moe = sum(isinstance(m, MoE) for m in model.modules())
        if moe:
            line += (
                f"; the routed experts of {moe} MoE layer(s) stay in high precision (torchao's grouped "
                "GEMM intercepts torch._grouped_mm, which these experts do not call directly)"
            )
        line += self._details()
        if self.emulated_on:
            line += f"; emulated on {self.emulated_on} ({text} rounding, no {text} units: no speed-up)"
        logger.info(line)

    def _details(self) -> str:
        return ""


class Float8Linears(_LowPrecisionLinears):
    """``float8_tensorwise`` / ``float8_rowwise``: torchao's ``Float8Linear`` in place of the chosen layers."""

    format = "float8"

    def __init__(
        self, recipe: str, *, all_gather: bool, skip_last_blocks: int, emulated_on: str | None
    ) -> None:
        super().__init__(skip_last_blocks=skip_last_blocks, emulated_on=emulated_on)
        self.recipe = recipe
        self.all_gather = all_gather
        """FSDP2 all-gathers the weights in FP8 (tensorwise with ``quantize.fsdp_float8_all_gather``)."""

    def convert(self, model: nn.Module) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        chosen = self.select(model)
        if self.recipe == "float8_tensorwise":  # the default config is the tensorwise recipe
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=self.all_gather)
        else:
            config = Float8LinearConfig.from_recipe_name("rowwise")
        # Float8Linear.from_float keeps the layer's own weight parameter (names unchanged).
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)

    def _details(self) -> str:
        return "; FSDP2 all-gathers their weights in FP8" if self.all_gather else ""

    def post_optimizer_step(self, model: nn.Module) -> None:
        """FP8 all-gather: every weight's scale for the next all-gather, in one all-reduce."""
        if self.all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)


class MXFP8Linears(_LowPrecisionLinears):
    """``mxfp8``: each chosen ``nn.Linear`` becomes torchao's ``MXFP8Linear`` in place (its class is
    swapped, as LoRA's is: parameters, names and hooks stay)."""

    format = "mxfp8"
    recipe = "mxfp8"

    def convert(self, model: nn.Module) -> None:
        with _quiet_imports():
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        # AUTO picks the sm100 kernels; EMULATED is torchao's hardware-agnostic PyTorch path.
        kernels = KernelPreference.EMULATED if self.emulated_on else KernelPreference.AUTO
        modules = dict(model.named_modules())
        for fqn in self.select(model):
            layer = modules[fqn]
            layer.__class__ = _mxfp8_linear()
            layer.kernel_preference = kernels
            layer.scale_calculation_mode = ScaleCalculationMode.RCEIL
            layer.wgrad_with_hp = False


@functools.cache
def _mxfp8_linear() -> type[nn.Linear]:
    """torchao's ``MXFP8Linear``, made to follow autocast (built once, when first needed)."""
    with _quiet_imports():
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear, _to_mxfp8_then_scaled_mm

    class AutocastMXFP8Linear(MXFP8Linear):
        """Under autocast torchao's layer would dequantize bf16 activations and fp32 weights each to
        its own dtype and fail to multiply them (torchao 0.18): both are cast to the autocast dtype
        first, as torchao's ``Float8Linear`` does. FSDP2's bf16 parameters need no cast."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            device = input.device.type
            if not torch.is_autocast_enabled(device):
                return super().forward(input)
            dtype = torch.get_autocast_dtype(device)
            with torch.autocast(device, enabled=False):
                output = _to_mxfp8_then_scaled_mm(
                    input.to(dtype),
                    self.weight.to(dtype),
                    kernel_preference=self.kernel_preference,
                    scale_calculation_mode=self.scale_calculation_mode,
                    wgrad_with_hp=self.wgrad_with_hp,
                )
                return output if self.bias is None else output + self.bias.to(output.dtype)

    return AutocastMXFP8Linear


def _some(names: list[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f", ... {len(names) - limit} more" if len(names) > limit else "")


__all__ = [
    "RECIPES",
    "Float8Linears",
    "MXFP8Linears",
    "QuantizeError",
    "build",
    "import_torchao",
    "problems",
    "select_linears",
]
