"""Model registry: the flavour tables the config validator checks, and :func:`build_model`.

Importing this costs ``import torch`` and nothing more; the Hugging Face adapter
(``portatrain.models.llama.hf``) and the memory estimator (``portatrain.models.memory``) are
imported only by the code that uses them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn

from portatrain.models.llama.model import LLAMA3_FLAVORS, Llama, LlamaArgs

if TYPE_CHECKING:
    from portatrain.config import ModelConfig

FLAVORS: dict[str, dict[str, LlamaArgs]] = {"llama3": LLAMA3_FLAVORS}
"""Architecture family -> flavour name -> arguments."""

_MODEL_CLASSES: dict[str, type[nn.Module]] = {"llama3": Llama}


def model_args(model_cfg: ModelConfig | Any, *, vocab_size: int | None = None) -> LlamaArgs:
    """The flavour's arguments with the config's and the tokenizer's overrides applied.

    ``vocab_size`` is the tokenizer's vocabulary size. It replaces the flavour's, so a debug model
    with a 258-token byte tokenizer gets a 258-row embedding. ``model_cfg.vocab_size``, when set,
    wins over both (e.g. to pad the table to a multiple of 64) but may not be smaller than the
    tokenizer's, or some token ids would index past the table.
    """
    family = FLAVORS.get(model_cfg.name)
    if family is None:
        raise ValueError(f"model.name={model_cfg.name!r} is unknown; choose one of {', '.join(FLAVORS)}")
    if model_cfg.flavor not in family:
        raise ValueError(
            f"model.flavor={model_cfg.flavor!r} is unknown for {model_cfg.name}; "
            f"choose one of {', '.join(family)}"
        )
    args = family[model_cfg.flavor]
    final_vocab = args.vocab_size if vocab_size is None else vocab_size
    if model_cfg.vocab_size is not None:
        if vocab_size is not None and model_cfg.vocab_size < vocab_size:
            raise ValueError(
                f"model.vocab_size={model_cfg.vocab_size} < tokenizer vocabulary {vocab_size}; "
                f"set model.vocab_size>={vocab_size} or leave it unset to use the tokenizer's"
            )
        final_vocab = model_cfg.vocab_size
    max_seq_len = args.max_seq_len if model_cfg.max_seq_len is None else model_cfg.max_seq_len
    return replace(args, vocab_size=final_vocab, max_seq_len=max_seq_len)


def build_model(model_cfg: ModelConfig | Any, *, vocab_size: int | None = None) -> nn.Module:
    """Construct the model on the current default device, without initializing it.

    Call under ``with torch.device("meta"):`` for anything large, parallelize, then ``to_empty()``
    and ``init_weights(model_cfg.init_std)`` (or load weights). See :func:`model_args` for how
    ``vocab_size`` and the config overrides combine.
    """
    return _MODEL_CLASSES[model_cfg.name](model_args(model_cfg, vocab_size=vocab_size))


__all__ = ["FLAVORS", "build_model", "model_args"]
