"""The one table of dtype names a config may use, and the lookup every stage goes through."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Config name -> torch dtype (``trainer.dtype``, ``parallel.param_dtype``/``reduce_dtype``, ``export.dtype``)."""

DTYPE_NAMES: tuple[str, ...] = tuple(DTYPES)


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; an unknown name is a ValueError listing the choices."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPE_NAMES)}") from None


def dtype_problem(key: str, value: str | None, *, allow: tuple[str, ...] = ()) -> list[str]:
    """``[]`` when ``value`` names a dtype (or one of ``allow``), else one problem naming ``key``."""
    if value in DTYPES or value in allow:
        return []
    return [f"{key}={value!r} is not one of {', '.join((*allow, *DTYPE_NAMES))}"]
