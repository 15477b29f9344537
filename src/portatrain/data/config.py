"""The data stage's allowed values and its config check, owned here (the schema in ``portatrain.config``
only lists the fields).

What this file does:
- one tuple of allowed values per ``data.*`` option (``COLLATORS``, ``LAST_BATCH``, ...);
- ``config_problems(data_cfg)``: every problem with a ``data`` config, as messages naming the key,
  the value and the fix. The config validation collects these with the other stages' problems and
  reports them all at once. Cheap: it looks at paths, never reads a corpus.
"""

from __future__ import annotations

import glob
import math
from pathlib import Path
from typing import Any

from portatrain.data.collate import OVERLONG_POLICIES
from portatrain.data.sampler import ORDERS
from portatrain.data.sources import FORMATS, SUFFIXES, is_hf_source, mix_sum_problem

COLLATORS = ("packing", "bucket", "pad_to_max")
"""``data.collator``: see ``collate.py``."""
LAST_BATCH = ("drop", "pad")
"""``data.last_batch``: drop an epoch's last partial global batch, or pad it with fully-masked rows."""
OVERLONG = OVERLONG_POLICIES
"""``data.overlong``: ``truncate``, ``split`` or ``error``."""
SAMPLERS = ORDERS
"""``data.sampler``: ``length_grouped``, ``random`` or ``sequential``."""
PACKING_ATTENTION = ("document", "causal")
"""``data.packing_attention``: ``document`` (block-diagonal mask, built on the device from per-position
document ids; positions restart per document) or ``causal`` (no mask: documents separated only by
EOS, SDPA's fused causal path; positions 0..S-1)."""
FORMATS = FORMATS
"""``data.format``: ``text``, ``prompt_response`` or ``chat``."""

CHOICES = {
    "collator": COLLATORS,
    "last_batch": LAST_BATCH,
    "overlong": OVERLONG,
    "sampler": SAMPLERS,
    "packing_attention": PACKING_ATTENTION,
    "format": FORMATS,
}


def dataset_problem(spec: str, key: str = "data.dataset") -> str | None:
    """Whether a dataset string can name anything, without reading it."""
    if spec == "builtin" or is_hf_source(spec):
        return None
    path = Path(str(spec)).expanduser()
    if any(ch in spec for ch in "*?["):
        return None if glob.glob(str(path), recursive=True) else f"{key}={spec!r}: the glob matches nothing"
    if path.exists():
        return None
    return (
        f"{key}={spec!r} does not exist; use builtin, a local {'/'.join(SUFFIXES)} file, directory or glob, "
        "a prepared corpus (portatrain prepare), or hf:NAME for a Hugging Face dataset"
    )


def config_problems(data: Any) -> list[str]:
    """Every problem with ``data`` (a ``DataConfig`` or its DictConfig); empty when it can run."""
    problems: list[str] = []
    for key, allowed in CHOICES.items():
        value = getattr(data, key, allowed[0])
        if value not in allowed:
            problems.append(f"data.{key}={value!r} is not one of {', '.join(allowed)}")
    minimums = {
        "seq_len": 2,
        "batch_size": 1,
        "group_size_multiplier": 1,
        "num_workers": 0,
        "prefetch": 0,
        "num_documents": 1,
    }
    for key, least in minimums.items():
        value = getattr(data, key, least)
        if value < least:
            why = " (a row needs at least 2 positions to predict anything)" if key == "seq_len" else ""
            problems.append(f"data.{key}={value} must be >= {least}{why}")
    buckets = list(data.buckets)
    if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 2:
        problems.append(
            f"data.buckets={buckets} must be a non-empty, strictly ascending list of lengths >= 2, e.g. [64,128,256]"
        )
    if not 0.0 <= data.eval_fraction < 1.0:
        problems.append(f"data.eval_fraction={data.eval_fraction} must be in [0, 1)")
    tokenizer = str(data.tokenizer)
    if tokenizer != "byte" and not (Path(tokenizer).expanduser() / "tokenizer.json").is_file():
        problems.append(
            f"data.tokenizer={tokenizer!r} is unknown: not 'byte' and not a directory holding tokenizer.json; "
            "use data.tokenizer=byte or a Hugging Face tokenizer directory"
        )
    mix = list(getattr(data, "mix", None) or [])
    if mix:
        weights: list[float] = []
        for i, entry in enumerate(mix):
            spec = entry.get("dataset") if hasattr(entry, "get") else None
            weight = entry.get("weight", 1.0) if hasattr(entry, "get") else None
            if not isinstance(spec, str):
                problems.append(
                    f"data.mix[{i}]={entry!r} needs a dataset, e.g. {{dataset: a.jsonl, weight: 2}}"
                )
                continue
            problem = dataset_problem(spec, f"data.mix[{i}].dataset")
            if problem:
                problems.append(problem)
            if not isinstance(weight, int | float) or not (weight > 0 and math.isfinite(weight)):
                problems.append(f"data.mix[{i}].weight={weight!r} must be a positive, finite number")
            else:
                weights.append(weight)
        if len(weights) == len(mix):  # each weight fine on its own: their sum must be too
            problem = mix_sum_problem(weights)
            if problem:
                problems.append(problem)
        if str(data.dataset) != "builtin":
            # data.mix replaces data.dataset: a dataset named beside it would be silently ignored.
            problems.append(
                f"data.dataset={data.dataset!r} is set together with data.mix, which replaces it; add it to "
                f"the mix as {{dataset: {data.dataset}, weight: ...}} or drop data.mix"
            )
    else:
        problem = dataset_problem(str(data.dataset))
        if problem:
            problems.append(problem)
    if not str(getattr(data, "text_field", "text")):
        problems.append("data.text_field is empty; name the record field that holds the text (default text)")
    return problems
