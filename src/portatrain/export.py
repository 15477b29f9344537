"""``portatrain export``: a portatrain checkpoint -> a Hugging Face model directory (``LlamaForCausalLM``,
``Qwen3ForCausalLM``... whatever the checkpoint's model family maps to).

What this file does:

- :func:`export_command` is the CLI command: ``portatrain export checkpoint=PATH|auto out=DIR``
  (``auto`` is the newest complete checkpoint under ``run_dir``);
- :func:`export_hf` writes ``config.json``, ``model-0000i-of-0000n.safetensors`` shards of at most
  ``export.max_shard_size`` each and ``model.safetensors.index.json``: what
  ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads, and what ``model.init_from=out``
  reads back (see :func:`portatrain.checkpoint.load_hf_weights`). The family comes from the
  checkpoint's ``trainer_state.json`` (``model_name``); its ``ModelSpec`` rebuilds the arguments and
  supplies the key renaming and ``config.json``.

The export streams: it reads from the DCP checkpoint only the tensors of one output shard at a time
(a partial ``dcp.load``), so its peak memory is about one shard, whatever the model size and however
many ranks saved it. It needs one process and no process group. The directory is written under a
temporary name and renamed when complete (removed when the export fails: a full disk, a damaged
checkpoint); an existing ``out`` is never overwritten.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from portatrain.checkpoint import (
    CheckpointError,
    ModelTensors,
    find_checkpoint,
    inspect_checkpoint,
    nonfinite_keys,
)
from portatrain.config import ExportConfig
from portatrain.dtypes import DTYPE_NAMES, DTYPES, dtype_problem
from portatrain.errors import ConfigError
from portatrain.finetune.lora import adapter_keys, save_peft_adapter
from portatrain.finetune.lora import merge_lora as merge_lora_into
from portatrain.train.build import checkpoint_spec

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
"""Where a LoRA checkpoint's export puts its adapters (PEFT's ``adapter_config.json`` + safetensors)."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def export_command(export: ExportConfig, run_dir: str | Path) -> Path:
    """The ``export`` subcommand: resolve ``export.checkpoint`` (against ``run_dir``) and write ``export.out``."""
    if not export.out:
        raise ConfigError("export.out is not set: portatrain export checkpoint=PATH|auto out=DIR")
    checkpoint = find_checkpoint(export.checkpoint, Path(run_dir))
    out = export_hf(
        checkpoint,
        Path(export.out),
        max_shard_size=parse_size(export.max_shard_size),
        dtype=export.dtype,
        merge_lora=export.merge_lora,
    )
    shards = len(list(out.glob("*.safetensors")))
    adapter = (
        f"; LoRA adapters in PEFT's format in {out / ADAPTER_DIR}" if (out / ADAPTER_DIR).is_dir() else ""
    )
    print(f"exported {checkpoint} -> {out}: {shards} safetensors shard(s), {export.dtype}{adapter}")
    return out


def parse_size(size: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (powers of 10 as in Hugging Face; ``GiB`` for powers of 2)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in _UNITS:
        raise ConfigError(f"export.max_shard_size={size!r} is not a size like 5GB, 500MB, 2GiB or 1000000")
    parsed = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if parsed < 1:
        # 0 would put every tensor in a shard of its own: hundreds of files, surely not what was meant.
        raise ConfigError(f"export.max_shard_size={size} must be at least 1 byte, e.g. 5GB or 500MB")
    return parsed


def export_problems(export: ExportConfig) -> list[str]:
    """The problems of an ``export`` config, each with its fix (for ``portatrain.validate``)."""
    problems = dtype_problem("export.dtype", export.dtype)
    try:
        parse_size(export.max_shard_size)
    except ConfigError as exc:
        problems.append(str(exc))
    return problems


def export_hf(
    checkpoint: Path, out: Path, *, max_shard_size: int, dtype: str = "float32", merge_lora: bool = False
) -> Path:
    """Write the model weights of a portatrain checkpoint as a Hugging Face model directory.

    A LoRA checkpoint (``finetune.method=lora``) writes the frozen base model (read from the base the
    checkpoint references: ``portatrain.checkpoint.base``) and, in ``out/adapter``, its adapters in
    PEFT's format (``peft.PeftModel.from_pretrained(base, out/adapter)``); with
    ``merge_lora`` the adapters are merged into the weights instead: a plain model.
    """
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ConfigError(f"export.dtype={dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    checkpoint = Path(checkpoint)
    state, metadata = inspect_checkpoint(checkpoint)
    _check_out(out)
    spec, args = checkpoint_spec(checkpoint, state, what="exported")

    with torch.device("meta"):
        like = spec.model_cls(args).state_dict()  # HF order: embedding, layers 0..n, norm, head
    keys = list(like)
    target = DTYPES[dtype]
    sizes = {key: like[key].numel() * target.itemsize for key in keys}
    shards = _plan_shards(keys, sizes, max_shard_size)
    # A LoRA checkpoint's frozen weights are read from the base it references, once that is checked.
    model_tensors = ModelTensors(checkpoint, state, metadata, like=like, spec=spec)
    lora = state.get("lora")
    adapters = model_tensors.read(adapter_keys(lora)) if lora else {}

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = model_tensors.read(shard)
            if lora and merge_lora:
                merge_lora_into(tensors, adapters, lora)
            bad = nonfinite_keys(tensors)  # the rule a checkpoint load applies
            if bad:
                raise CheckpointError(
                    f"checkpoint {checkpoint} holds non-finite (NaN/inf) weights in model.{', model.'.join(bad[:4])}"
                    f"{' and more' if len(bad) > 4 else ''}; not exporting them. Export an earlier step_* "
                    "directory (training stops before saving non-finite weights: this checkpoint was made "
                    "otherwise)"
                )
            hf = {k: v.to(target).contiguous() for k, v in spec.hf.to_hf(tensors).items()}
            _save_safetensors(save_file, hf, tmp / name)
            _share_mode(tmp / name)
            weight_map.update(dict.fromkeys(hf, name))
            del tensors, hf

        _write_config_and_tokenizer(
            tmp, spec.hf.config(args, torch_dtype=dtype), state.get("tokenizer", "byte")
        )
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if lora and not merge_lora:
            if nonfinite_keys(adapters):
                raise CheckpointError(
                    f"checkpoint {checkpoint} holds non-finite LoRA adapters; not exporting them"
                )
            save_peft_adapter(tmp / ADAPTER_DIR, adapters, lora, to_hf=spec.hf.to_hf, base_model=str(out))
            _share_mode(tmp / ADAPTER_DIR, directory=True)
        _share_mode(tmp, directory=True)
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export leaves no partial directory
        raise
    logger.debug(
        "exported step %s: %d shard(s), %.1f MB", state["step"], len(shards), sum(sizes.values()) / 1e6
    )
    return out


def _check_out(out: Path) -> None:
    """``export.out`` must be a new or empty directory (an export never overwrites anything)."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(
            f"export.out={out} is an existing file; export writes a directory there -- choose a new path"
        )
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"export.out={out} already exists and is not empty; choose a new directory")


def _write_config_and_tokenizer(directory: Path, config: dict[str, Any], tokenizer_name: str) -> None:
    """``config.json`` with the tokenizer's special ids, and the tokenizer's own files next to the
    weights, so ``AutoTokenizer.from_pretrained(out)`` just works."""
    from portatrain.data.tokenizer import build_tokenizer, copy_tokenizer_files

    tokenizer = build_tokenizer(tokenizer_name)
    ids = {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
    }
    (directory / "config.json").write_text(json.dumps({**config, **ids}, indent=2) + "\n")
    copy_tokenizer_files(tokenizer_name, directory)


def _save_safetensors(save_file: Any, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file``, whose I/O errors (a full or read-only disk) are a ``SafetensorError`` carrying
    only text ("... (os error 28)"): raised as the ``OSError`` they are, so the CLI reports them."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except Exception as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from exc


def _share_mode(path: Path, *, directory: bool = False) -> None:
    """The mode a new file or directory gets from the umask (safetensors writes 0600): an export is
    meant to be shared, as a team's umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod((0o777 if directory else 0o666) & ~umask)


def _plan_shards(keys: list[str], sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Greedy, in order: a new shard starts when the next tensor would overflow this one.

    A tensor larger than the limit gets a shard of its own (safetensors cannot split a tensor).
    """
    shards: list[list[str]] = [[]]
    used = 0
    for key in keys:
        if shards[-1] and used + sizes[key] > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += sizes[key]
    return shards
