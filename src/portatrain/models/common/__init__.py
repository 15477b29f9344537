"""The parts every decoder family shares, and :func:`decoder_spec`, which turns a family's own pieces
into its :class:`~portatrain.models.spec.ModelSpec`.

* ``rope.py`` -- RoPE tables (plain, Llama 3.1 scaling, YaRN);
* ``mla.py`` -- multi-head latent attention (DeepSeek-V2/V3);
* ``mtp.py`` -- multi-token prediction's depths, read-ahead targets and loss hooks (DeepSeek-V3);
* ``qk_clip.py`` -- QK-clip (``optim.qk_clip``): each head's largest attention logit, measured in the
  forward, caps its query/key projections after the step (Kimi K2's MuonClip);
* ``layers.py`` -- RMSNorm, SwiGLU feed-forward, grouped-query attention with a q/k-norm kind, and
  the kernel slots (``rmsnorm_fn``, ``swiglu_fn``, ``rope_fn``);
* ``decoder.py`` -- the arguments mixin (shape problems, parameter count, FLOPs), the block with its
  norm placement and the whole model;
* ``parallelize.py`` -- the parallel plan (TP -> activation checkpointing -> compile -> FSDP2) and the
  layouts it refuses;
* ``hf.py`` -- Hugging Face key renaming and the config keys every family writes.

The memory estimate (``portatrain.models.memory``) is shared too. torchtitan keeps its shared layers
the same way (``torchtitan/models/common/``); litgpt drives its architectures from one model file
(``litgpt/model.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from torch import nn

from portatrain.models.memory import estimate_memory
from portatrain.models.spec import HFMapping, ModelRuntime, ModelSpec, RuntimeOptions


def parallelize(model: nn.Module, parallel_dims: Any, **options: Any) -> nn.Module:
    """:func:`portatrain.models.common.parallelize.parallelize_decoder`, imported when first used: the
    registry is imported by the config validator, which should not pay for FSDP and tensor parallel."""
    from portatrain.models.common.parallelize import parallelize_decoder

    return parallelize_decoder(model, parallel_dims, **options)


def runtime(model: nn.Module, options: RuntimeOptions) -> ModelRuntime:
    """The shared decoder's hooks around the step: its mixture-of-experts layers' (none: no-ops),
    multi-token prediction's when the model has depths of it (``mtp.py``), QK-clip's when
    ``optim.qk_clip`` is on (``qk_clip.py``)."""
    from portatrain.models.common.moe import MoERuntime
    from portatrain.models.common.mtp import MTPRuntime
    from portatrain.models.common.qk_clip import QKClipRuntime

    hooks: ModelRuntime = MoERuntime(model, options)
    # By the arguments: a pipeline rank before the last holds no depth (mtp is None) but takes part in the metric.
    if getattr(getattr(model, "args", None), "mtp_layers", 0):
        hooks = MTPRuntime(model, hooks, options.sum_stages)
    if options.qk_clip:
        hooks = QKClipRuntime(model, hooks, options.qk_clip, options.reduce_max)
    return hooks


def layout_problems(parallel: Any, args: Any) -> list[str]:
    """:func:`portatrain.models.common.parallelize.layout_problems`, imported when first used."""
    from portatrain.models.common.parallelize import layout_problems as problems

    return problems(parallel, args)


def decoder_spec(
    name: str,
    model_cls: type[nn.Module],
    args_cls: type,
    flavors: Mapping[str, Any],
    hf: ModuleType,
    *,
    published_params: Mapping[str, int],
    config_overrides: Mapping[str, str] | None = None,
) -> ModelSpec:
    """The spec of a family built from the shared parts: the shared plan, memory estimate and layout
    check; ``hf`` is the family's ``hf.py`` (``ARCHITECTURE``, ``to_hf``, ``from_hf``, ``hf_config``,
    ``args_from_hf_config``)."""
    return ModelSpec(
        name=name,
        model_cls=model_cls,
        args_cls=args_cls,
        flavors=flavors,
        parallelize=parallelize,
        hf=HFMapping(
            architecture=hf.ARCHITECTURE,
            to_hf=hf.to_hf,
            from_hf=hf.from_hf,
            config=hf.hf_config,
            args_from_config=hf.args_from_hf_config,
        ),
        estimate_memory=estimate_memory,
        published_params=published_params,
        layout_problems=layout_problems,
        config_overrides=config_overrides or {},
        runtime=runtime,
    )
