"""The model-family registry: one :class:`~portatrain.models.spec.ModelSpec` per family.

Generic code reaches a family only through :func:`get_spec` (``cfg.model.name`` -> spec). Adding a
family is one folder under ``portatrain/models/`` that builds its spec, one entry in :data:`SPECS`
below and its ``conf/model/`` files; a family's own ``model.*`` keys are its spec's ``options`` and
join the config schema through :data:`ModelSchema`. :func:`model_args` and :func:`build_model` turn
a ``ModelConfig`` (flavour + custom sizes) into arguments and a model; :func:`model_problems` is the
model stage's part of config validation.

Importing this costs ``import torch`` and the families' model files; each family's parallel plan is
imported when first applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from torch import nn

from portatrain.config import ModelConfig
from portatrain.errors import ConfigError
from portatrain.models.common.moe import DISPATCH_MODES
from portatrain.models.deepseek_v3 import DEEPSEEK_V3
from portatrain.models.gemma3 import GEMMA3
from portatrain.models.gpt_oss import GPT_OSS
from portatrain.models.llama import LLAMA3
from portatrain.models.olmo2 import OLMO2
from portatrain.models.qwen3 import QWEN3
from portatrain.models.qwen3_moe import QWEN3_MOE
from portatrain.models.spec import ModelSpec

SPECS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (LLAMA3, QWEN3, OLMO2, QWEN3_MOE, DEEPSEEK_V3, GEMMA3, GPT_OSS)
}
"""Model family name (``model.name``) -> its spec. One entry per family."""


def model_schema(specs: Iterable[ModelSpec]) -> type[ModelConfig]:
    """:class:`ModelConfig` with the :attr:`~ModelSpec.options` fields of every family in ``specs``."""
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    declared: dict[str, tuple[str, dataclasses.Field]] = {}
    options = {}
    for spec in specs:
        for f in dataclasses.fields(spec.options) if spec.options is not None else ():
            # A wrong declaration is the family author's bug: it fails at import, in every test.
            if f.name in shared or f.default is not None:
                raise TypeError(
                    f"{spec.name}: option {f.name} must default to None (keep the flavour's value) and "
                    "not repeat a shared ModelConfig key"
                )
            first, earlier = declared.setdefault(f.name, (spec.name, f))
            if earlier.type != f.type:
                raise TypeError(f"model.{f.name} is {earlier.type} in {first} but {f.type} in {spec.name}")
            options[spec.options] = None
    schema = dataclasses.make_dataclass("ModelSchema", [], bases=(*options, ModelConfig))
    schema.__module__ = __name__  # where a pickled config finds it
    return schema


ModelSchema = model_schema(SPECS.values())
"""The ``model`` section's schema (``portatrain.config.register_configs(ModelSchema)``): the shared
keys of :class:`ModelConfig` and every family's own, so a misspelt ``model.<key>`` is an error and one
of another family is refused by name (:meth:`ModelSpec.args`)."""

ARCH_OVERRIDES: tuple[str, ...] = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "head_dim",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "max_seq_len",
    "n_experts",
    "top_k",
    "moe_ffn_dim",
    *(f.name for f in dataclasses.fields(ModelSchema)[len(dataclasses.fields(ModelConfig)) :]),
)
"""``model.*`` keys that change the architecture on top of the flavour (None keeps it): the shared
custom sizes, then the families' own options. ``vocab_size`` is handled apart: it combines with the
tokenizer's (see :func:`model_args`)."""


def get_spec(name: str) -> ModelSpec:
    """The spec of family ``name``; an unknown name is a :class:`ConfigError` listing the families."""
    spec = SPECS.get(name)
    if spec is None:
        raise ConfigError(f"model.name={name!r} is unknown; choose one of {', '.join(SPECS)}")
    return spec


def model_args(model_cfg: ModelConfig, *, vocab_size: int | None = None):
    """The flavour's arguments with the config's custom sizes and the tokenizer's vocabulary applied.

    ``vocab_size`` is the tokenizer's vocabulary size. It replaces the flavour's, so a debug model
    with a 258-token byte tokenizer gets a 258-row embedding. ``model_cfg.vocab_size``, when set,
    wins over both (e.g. to pad the table to a multiple of 64) but may not be smaller than the
    tokenizer's, or some token ids would index past the table. Raises :class:`ConfigError` listing
    every problem (unknown family or flavour, unsupported key, inconsistent sizes).
    """
    args, problems = _resolve(model_cfg, vocab_size)
    if problems:
        raise ConfigError("invalid model config:\n  - " + "\n  - ".join(problems))
    return args


def model_problems(model_cfg: ModelConfig) -> list[str]:
    """Every problem of the ``model`` config group (the validator's model-stage check)."""
    return _resolve(model_cfg, None)[1] + _moe_problems(model_cfg)


def _resolve(model_cfg: ModelConfig, vocab_size: int | None):
    spec = SPECS.get(model_cfg.name)
    if spec is None:
        return None, [f"model.name={model_cfg.name!r} is unknown; choose one of {', '.join(SPECS)}"]
    if model_cfg.vocab_size is not None and vocab_size is not None and model_cfg.vocab_size < vocab_size:
        return None, [
            f"model.vocab_size={model_cfg.vocab_size} < tokenizer vocabulary {vocab_size}; "
            f"set model.vocab_size>={vocab_size} or leave it unset to use the tokenizer's"
        ]
    overrides = {key: getattr(model_cfg, key, None) for key in ARCH_OVERRIDES}
    overrides["vocab_size"] = model_cfg.vocab_size if model_cfg.vocab_size is not None else vocab_size
    problems = []
    try:
        args = spec.args(model_cfg.flavor, **overrides)
    except KeyError as exc:  # an unknown flavour: nothing to check the sizes against
        return None, [str(exc.args[0])]
    except (ValueError, TypeError) as exc:  # an unsupported key: report it, check the others anyway
        problems.append(str(exc))
        fields = {f.name for f in dataclasses.fields(spec.args_cls)}
        supported = {k: v for k, v in overrides.items() if k in spec.config_overrides or k in fields}
        try:
            args = spec.args(model_cfg.flavor, **supported)
        except (ValueError, TypeError) as again:  # a family that validates on construction
            return None, [*problems, str(again)]
    where = f"{model_cfg.name}/{model_cfg.flavor}"
    if any(v is not None for v in overrides.values()):
        where += " with the model.* overrides"
    return args, problems + [f"model {where}: {problem}" for problem in args.problems()]


def moe_dispatch(model_cfg: ModelConfig, *, static_shapes: bool) -> str:
    """The dispatch a mixture of experts uses (``model.moe_dispatch``; ``auto`` follows the device)."""
    if model_cfg.moe_dispatch != "auto":
        return model_cfg.moe_dispatch
    return "capacity" if static_shapes else "dropless"


def _moe_problems(model_cfg: ModelConfig) -> list[str]:
    problems = []
    if model_cfg.moe_dispatch not in ("auto", *DISPATCH_MODES):
        problems.append(
            f"model.moe_dispatch={model_cfg.moe_dispatch!r} is not one of auto, {', '.join(DISPATCH_MODES)}"
        )
    if not model_cfg.capacity_factor > 0 or model_cfg.capacity_factor == float("inf"):
        problems.append(
            f"model.capacity_factor={model_cfg.capacity_factor} must be a positive number (slots per expert "
            "per expected assignment, e.g. 1.25)"
        )
    return problems


def build_model(model_cfg: ModelConfig, *, vocab_size: int | None = None) -> nn.Module:
    """Construct the model on the current default device, without initializing it.

    Call under ``with torch.device("meta"):`` for anything large, parallelize, then ``to_empty()``
    and ``init_weights(model_cfg.init_std)`` (or load weights). See :func:`model_args` for how
    ``vocab_size`` and the config overrides combine.
    """
    return get_spec(model_cfg.name).model_cls(model_args(model_cfg, vocab_size=vocab_size))


__all__ = [
    "ARCH_OVERRIDES",
    "SPECS",
    "ModelSchema",
    "build_model",
    "get_spec",
    "model_args",
    "model_schema",
    "model_problems",
    "moe_dispatch",
]
