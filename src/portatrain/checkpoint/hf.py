"""Hugging Face interop for checkpoints: ``model.init_from=DIR`` initializes a model from a local
Hugging Face safetensors directory, each rank reading only the slices it holds
(:func:`load_hf_weights`); :func:`read_hf_tensors` reads chosen tensors of one (the frozen base of a
LoRA run that started from it: ``portatrain.checkpoint.base``).

Family-agnostic: the key renaming and the config translation come from the family's
:class:`~portatrain.models.spec.HFMapping` (``spec.hf``). The reverse direction (a checkpoint -> a
Hugging Face directory) is ``portatrain export`` (``portatrain.export``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from portatrain.checkpoint.common import CheckpointError, some
from portatrain.finetune.lora import is_adapter_key

if TYPE_CHECKING:
    from portatrain.config import ModelConfig
    from portatrain.models.spec import ModelSpec

# config.json fields that may differ between the file and the model: the RoPE table length is a
# training choice, the dtype a storage one, and tying is checked on its own below.
# Keys that may differ between the file and the model. num_nextn_predict_layers counts multi-token-
# prediction layers stored after the main ones (DeepSeek-V3's layer 61): a model without them does not
# read them, and a model with more than the file has finds its tensors missing, one error naming them.
_FREE_CONFIG_KEYS = (
    "max_position_embeddings",
    "torch_dtype",
    "tie_word_embeddings",
    "num_nextn_predict_layers",
)


def load_hf_weights(model: nn.Module, hf_dir: str | Path, spec: ModelSpec) -> None:
    """Initialize ``model`` (of family ``spec``, possibly FSDP2-sharded) from a local HF directory.

    Reads ``config.json`` to check the architecture, then the ``*.safetensors`` files through
    DCP's ``HuggingFaceStorageReader``: each rank reads only the slices of the tensors it holds
    (safetensors slicing on memory-mapped files), so no rank ever materializes the full model.
    Weights are cast to the model's dtype. A tied HF checkpoint (no ``lm_head.weight``) loaded
    into an untied model initializes the output projection from the embedding.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    hf_dir = Path(hf_dir)
    config_file, config = read_hf_config(hf_dir)
    architecture = (config.get("architectures") or [spec.hf.architecture])[0]
    if architecture != spec.hf.architecture:
        raise CheckpointError(
            f"model.init_from: {config_file} is a {architecture}, but this run's model.name={spec.name} "
            f"reads {spec.hf.architecture}; choose the model config of that family (model=...)"
        )
    try:
        theirs = spec.hf.args_from_config(config)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(
            f"model.init_from: {config_file} is not a usable {spec.hf.architecture} config: {exc}"
        ) from None
    ours = getattr(model, "args", None)
    if ours is not None:
        _check_hf_args(config_file, spec, theirs, ours)

    # LoRA adapters (finetune.method=lora) are not in the base model's files: they start from their init.
    full = get_model_state_dict(model)
    base = {k: v for k, v in full.items() if not is_adapter_key(k)}
    state = read_hf_tensors(hf_dir, base, spec)
    set_model_state_dict(model, state, options=StateDictOptions(strict=len(base) == len(full)))


def read_hf_config(hf_dir: Path) -> tuple[Path, dict[str, Any]]:
    """``config.json`` of a Hugging Face directory with safetensors weights (its path and content);
    a :class:`CheckpointError` naming the file and the fix when either is missing or unreadable."""
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"model.init_from={hf_dir}: {config_file} is missing; point it at a Hugging Face model "
            "directory (config.json + *.safetensors), e.g. one written by `portatrain export` or "
            "save_pretrained()"
        )
    if not any(hf_dir.glob("*.safetensors")):
        raise CheckpointError(
            f"model.init_from={hf_dir}: no *.safetensors file there (only safetensors weights are "
            "read; convert .bin files with save_pretrained(safe_serialization=True))"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(
            f"model.init_from={hf_dir}: {config_file} is not readable JSON ({type(exc).__name__}: {exc}); "
            "point it at a Hugging Face model directory written by `portatrain export` or save_pretrained()"
        ) from None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"model.init_from={hf_dir}: {config_file} holds a JSON {type(config).__name__}, not the object "
            "of a Hugging Face config; point it at a Hugging Face model directory"
        )
    return config_file, config


def embedding_rows(model_cfg: ModelConfig, tokenizer_vocab: int, tokenizer_name: str) -> int:
    """The rows of the embedding the run builds: the tokenizer's vocabulary, or with
    ``model.init_from`` the checkpoint's own rows, read from its ``config.json`` before anything is built.

    Hugging Face checkpoints pad their embedding past the tokenizer (Qwen3: 151,669 tokens, 151,936
    rows; https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json), so a smaller tokenizer is
    normal and the model takes the checkpoint's rows; a larger one would index past them, and a
    ``model.vocab_size`` other than the rows could not load them: both are refused here.
    """
    if not model_cfg.init_from:
        return tokenizer_vocab
    from portatrain.models import get_spec

    hf_dir, spec = Path(model_cfg.init_from), get_spec(model_cfg.name)
    try:
        config_file, config = read_hf_config(hf_dir)
    except CheckpointError:  # a resume does not read the directory; load_hf_weights names what is wrong
        return tokenizer_vocab
    try:
        if (config.get("architectures") or [spec.hf.architecture])[0] != spec.hf.architecture:
            raise ValueError("another family")
        rows = int(spec.hf.args_from_config(config).vocab_size)
    except (ValueError, KeyError, TypeError):
        return tokenizer_vocab  # not this family's config: load_hf_weights names what is wrong
    if tokenizer_vocab > rows:
        raise CheckpointError(
            f"data.tokenizer={tokenizer_name} has {tokenizer_vocab:,} tokens but model.init_from={hf_dir} "
            f"has {rows:,} embedding rows ({config_file.name} vocab_size), so ids from {rows:,} up have no "
            "row; train with the tokenizer saved with those weights (data.tokenizer=<its directory>)"
        )
    if model_cfg.vocab_size is not None and model_cfg.vocab_size != rows:
        raise CheckpointError(
            f"model.vocab_size={model_cfg.vocab_size} but model.init_from={hf_dir} has {rows:,} embedding "
            f"rows ({config_file.name} vocab_size); set model.vocab_size={rows} or leave it unset "
            "(the checkpoint's rows are then used)"
        )
    return rows


def read_hf_tensors(
    hf_dir: str | Path, template: Mapping[str, torch.Tensor], spec: ModelSpec
) -> dict[str, torch.Tensor]:
    """``template``'s tensors (portatrain's names; plain tensors or this rank's DTensor shards) read
    from the ``*.safetensors`` of ``hf_dir``, renamed by the family's mapping, cast to the template's
    dtypes; a tied HF checkpoint (no ``lm_head.weight``) gives the head the embedding's weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    hf_dir = Path(hf_dir)
    reader = HuggingFaceStorageReader(str(hf_dir))
    try:
        metadata = reader.read_metadata()
    except Exception as exc:
        raise CheckpointError(f"model.init_from: cannot read the safetensors in {hf_dir}: {exc}") from None
    state = spec.hf.to_hf(dict(template))
    available = metadata.state_dict_metadata
    missing = [k for k in state if k not in available]
    untie = missing == ["lm_head.weight"] and "model.embed_tokens.weight" in available
    if missing and not untie:
        raise CheckpointError(f"model.init_from: {hf_dir} lacks tensors this model needs: {some(missing)}")
    wrong = [
        f"{k}: file {list(available[k].size)}, model {list(v.shape)}"
        for k, v in state.items()
        if k in available and tuple(available[k].size) != tuple(v.shape)
    ]
    if wrong:
        raise CheckpointError(
            f"model.init_from: {hf_dir} does not fit this model:\n  - " + "\n  - ".join(wrong)
        )
    head = state.pop("lm_head.weight") if untie else None
    try:
        dcp.load(state, storage_reader=reader)
        if head is not None:  # the HF model ties its head to the embedding; this one has its own
            dcp.load(
                {"model.embed_tokens.weight": head}, storage_reader=HuggingFaceStorageReader(str(hf_dir))
            )
            state["lm_head.weight"] = head
    except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
        raise CheckpointError(
            f"model.init_from: reading {hf_dir} failed: {type(exc).__name__}: {exc}"
        ) from exc
    return spec.hf.from_hf(state)


def _check_hf_args(config_file: Path, spec: ModelSpec, theirs: Any, ours: Any) -> None:
    """Compare the architectures as Hugging Face configs: the family's own translation of both."""
    theirs_hf: Mapping[str, Any] = spec.hf.config(theirs, torch_dtype="float32")
    ours_hf: Mapping[str, Any] = spec.hf.config(ours, torch_dtype="float32")
    problems = [
        f"{key}: {config_file.name} has {theirs_hf.get(key)}, the model {ours_hf.get(key)}"
        for key in dict.fromkeys([*ours_hf, *theirs_hf])
        if key not in _FREE_CONFIG_KEYS and theirs_hf.get(key) != ours_hf.get(key)
    ]
    if ours.tie_embeddings and not theirs.tie_embeddings:
        problems.append("tie_embeddings: the file has a separate lm_head, the model ties it to the embedding")
    if problems:
        raise CheckpointError(
            f"model.init_from: {config_file} describes another architecture than this recipe's model:\n  - "
            + "\n  - ".join(problems)
            + "\nPick the recipe/model.flavor that matches it (or set the model.* sizes to match)."
        )
