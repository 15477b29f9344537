"""lm-evaluation-harness tasks: find them, check their names, run them, flatten their metrics.

- :func:`task_names` -- ``eval.tasks`` / ``trainer.eval_tasks`` as a list (a name, ``a,b`` or ``[a,b]``);
- :func:`task_manager` -- lm-eval's ``TaskManager`` over ``eval.include_path`` (local YAML task files)
  and, only when a name is not found there, lm-eval's own task folders too: indexing lm-eval's
  ~15,000 built-in tasks costs seconds of CPU, which a local task never pays;
- :func:`eval_problems` / :func:`task_problems` -- the config check: an unknown task is named with how to list tasks and
  where local task files go, and a task that cannot run here is named with why (its Python helpers
  need a package that is not installed; it builds its data from lm-eval metadata such as a tokenizer
  name, which portatrain does not pass) -- ``portatrain.validate`` calls it before anything is built;
- :func:`run_tasks` -- ``lm_eval.simple_evaluate`` on a :class:`~portatrain.evaluation.lm.PortatrainLM`,
  leaving the process's random states as they were (lm-eval seeds ``random``, NumPy and torch);
- :func:`flat_metrics` -- lm-eval's results as ``{"eval/<task>/<metric>": value}`` for the metric sinks.

A local task is a YAML file in a folder of ``eval.include_path``, its data a local jsonl file
(``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``): nothing is downloaded.
``examples/lm_eval_tasks/`` is one (used by the tests and ``docs/evaluation.md``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from portatrain.config import CompileConfig, EvalConfig, TrainerConfig

logger = logging.getLogger(__name__)

LIST_TASKS_HINT = (
    "list lm-eval's tasks with `lm-eval ls tasks`; put a local task's YAML file in a folder given "
    "as eval.include_path=[DIR] (see examples/lm_eval_tasks)"
)


def task_names(value: Any) -> list[str]:
    """``portatrain_tiny``, ``'a,b'`` or ``[a, b]`` -> a list of task names (empty: none)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return [name.strip() for item in items for name in str(item).split(",") if name.strip()]


@lru_cache(maxsize=4)
def _manager(include_path: tuple[str, ...], include_defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    paths = [str(Path(p).resolve()) for p in include_path] or None
    return TaskManager(include_path=paths, include_defaults=include_defaults)


def task_manager(names: Sequence[str], include_path: Sequence[str] = ()) -> Any:
    """A ``TaskManager`` that knows ``names``: the local folders alone when they hold every one
    (fast), else the local folders over lm-eval's own tasks. Cached per process."""
    include = tuple(str(p) for p in include_path)
    if include:
        local = _manager(include, False)
        if not _unknown(local, names):
            return local
    return _manager(include, True)


def _unknown(manager: Any, names: Sequence[str]) -> list[str]:
    """Names that are neither a registered task, group or tag nor a YAML file."""
    known = set(manager.all_tasks)
    return [n for n in names if n not in known and not (n.endswith((".yaml", ".yml")) and Path(n).is_file())]


def eval_problems(cfg: EvalConfig, trainer: TrainerConfig, compile_cfg: CompileConfig) -> list[str]:
    """The problems of the ``eval`` section and of ``trainer.eval_tasks`` (for ``portatrain.validate``)."""
    problems = []
    if trainer.eval_tasks_every < 0:
        problems.append(
            f"trainer.eval_tasks_every={trainer.eval_tasks_every} must be >= 0 (0: trainer.eval_every's interval)"
        )
    in_training = task_names(trainer.eval_tasks)
    if in_training and not (trainer.eval_tasks_every or trainer.eval_every):
        problems.append(
            f"trainer.eval_tasks={in_training} would never run: trainer.eval_tasks_every=0 follows "
            "trainer.eval_every, which is 0; set trainer.eval_tasks_every=N"
        )
    if in_training and compile_cfg.enabled and compile_cfg.warmup and compile_cfg.on_recompile == "error":
        problems.append(
            f"trainer.eval_tasks={in_training} with compile.warmup=true: lm-eval's requests come in every "
            "length, each a new shape the armed recompile guard refuses; set compile.on_recompile=warn"
        )
    return problems + task_problems(cfg, [*task_names(cfg.tasks), *in_training])


def task_problems(cfg: EvalConfig, names: Sequence[str]) -> list[str]:
    """The problems of running tasks ``names`` with ``cfg``'s settings."""
    problems = []
    missing = [p for p in cfg.include_path if not Path(p).exists()]
    if missing:
        problems.append(
            f"eval.include_path: {', '.join(map(str, missing))} does not exist; give folders holding "
            "lm-eval task YAML files"
        )
    for field in ("batch_size", "max_gen_toks"):
        if getattr(cfg, field) <= 0:
            problems.append(f"eval.{field}={getattr(cfg, field)} must be positive")
    if cfg.limit is not None and not cfg.limit > 0:
        problems.append(
            f"eval.limit={cfg.limit} must be positive: a number of documents per task (e.g. 100), or a "
            "fraction below 1; null evaluates every document"
        )
    if cfg.num_fewshot is not None and cfg.num_fewshot < 0:
        problems.append(f"eval.num_fewshot={cfg.num_fewshot} must be >= 0, or null for each task's own")
    if cfg.bootstrap_iters < 0:
        problems.append(f"eval.bootstrap_iters={cfg.bootstrap_iters} must be >= 0 (0: no standard errors)")
    if not names or problems:
        return problems
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return [f"lm-eval tasks {list(names)} need the lm-eval package: pip install 'portatrain[eval]'"]
    manager = task_manager(names, cfg.include_path)
    unknown = _unknown(manager, names)
    if unknown:
        problems.append(f"unknown lm-eval task(s) {', '.join(map(repr, unknown))}: {LIST_TASKS_HINT}")
        return problems
    return _unrunnable(manager, names)


def _unrunnable(manager: Any, names: Sequence[str]) -> list[str]:
    """Why tasks among ``names`` (groups and tags expanded) cannot run on a portatrain model, each
    one line: their YAML's Python helpers import a package that is missing (RULER's need
    ``lm_eval[ruler]``: lm-eval raised it only after the model was loaded), or they generate their
    data with ``custom_dataset`` from lm-eval's metadata (RULER's ``niah_*`` size their prompts with a
    Hugging Face tokenizer named there), which ``run_tasks`` does not pass.

    Reads lm-eval's task index (``lm_eval/tasks/_index.py``, ``_yaml_loader.py`` of lm-eval 0.4.13);
    an lm-eval without them is not checked here (its own error then comes at run time).
    """
    try:
        from lm_eval.tasks._index import Kind, TaskIndex
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:
        return []
    index = manager.task_index
    leaves: dict[str, Any] = {}  # task name -> its Entry, or its inline config (a dict)

    def expand(item: Any, seen: frozenset[str] = frozenset()) -> None:
        if isinstance(item, dict):  # a group's member by config: a known one (with overrides), or inline
            ref = item.get("group") if "group" in item else item.get("task")
            if isinstance(ref, str) and ref in index:
                expand(ref, seen)
            elif "group" in item:
                members = item.get("task") or []
                for member in members if isinstance(members, list) else [members]:
                    expand(member, seen)
            elif isinstance(ref, str):
                leaves.setdefault(ref, item)
            return
        if item in seen:
            return
        entry = index.get(item)
        if entry is None and str(item).endswith((".yaml", ".yml")):
            entry = TaskIndex.entry_from_path(Path(item))
        if entry is None:
            return
        if entry.kind == Kind.TAG:
            for member in sorted(entry.tags):
                expand(member, seen | {item})
        elif entry.kind == Kind.GROUP:
            config = load_yaml(entry.yaml_path, resolve_func=False) if entry.yaml_path else entry.cfg or {}
            members = config.get("task") or []
            for member in members if isinstance(members, list) else [members]:
                expand(member, seen | {item})
        else:
            leaves.setdefault(entry.name, entry)

    for name in names:
        expand(name)
    problems = []
    for task, entry in sorted(leaves.items()):
        if isinstance(entry, dict):
            config = entry
        elif entry.yaml_path is None:
            continue  # a Python-defined task: nothing to read ahead
        else:
            try:
                config = load_yaml(entry.yaml_path, resolve_func=True)
            except ImportError as exc:
                reason = " ".join(str(exc).split())
                problems.append(
                    f"lm-eval task {task!r} needs a package that is not installed: {reason} "
                    "(an extra of lm-eval's; install it, or choose another task)"
                )
                continue
        if "custom_dataset" in config:
            problems.append(
                f"lm-eval task {task!r} generates its data from lm-eval metadata (e.g. a Hugging Face "
                "tokenizer name to size its prompts), which portatrain does not pass; run it with lm-eval "
                "on the checkpoint's export (portatrain export, then lm-eval run --model hf --model_args "
                f"pretrained=OUT --tasks {task}), or choose another task"
            )
    return problems


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's CPU random states afterwards (lm-eval reseeds them).
    Device generators are the caller's (``Accelerator.get_rng_state``)."""
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def run_tasks(
    lm: Any, names: Sequence[str], cfg: EvalConfig, *, bootstrap_iters: int | None = None, quiet: bool = False
) -> dict | None:
    """Run lm-eval tasks ``names`` on ``lm``; lm-eval's results dict (``results``, ``configs``...) on
    the process with ``LOCAL_RANK`` 0, None on the others (which run the same forwards: lm-eval
    aggregates on one process per host). ``quiet``: lm-eval logs warnings only (between training
    steps); so it does on every rank but 0 of a process group (every rank runs the same requests,
    and each would print lm-eval's progress once more)."""
    from lm_eval import simple_evaluate

    lm_eval_logger = logging.getLogger("lm_eval")
    level = lm_eval_logger.level
    if quiet or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        lm_eval_logger.setLevel(logging.WARNING)
    with preserved_random_state():
        try:
            return simple_evaluate(
                model=lm,
                tasks=list(names),
                num_fewshot=cfg.num_fewshot,
                limit=cfg.limit,
                bootstrap_iters=cfg.bootstrap_iters if bootstrap_iters is None else bootstrap_iters,
                log_samples=False,
                task_manager=task_manager(names, cfg.include_path),
            )
        finally:
            lm_eval_logger.setLevel(level)


def flat_metrics(results: dict | None) -> dict[str, float]:
    """``{"eval/<task>/<metric>": value}`` for every finite number of lm-eval's ``results`` (standard
    errors left out; none where lm-eval returned None); a metric under a filter other than ``none``
    is ``<metric>/<filter>``."""
    flat = {}
    for task, metrics in (results or {}).get("results", {}).items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")  # "acc,none"; "alias", "sample_len" are no metric
            if (
                not comma
                or "_stderr" in metric
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
            ):
                continue
            if not math.isfinite(value):
                continue
            name = metric if filt == "none" else f"{metric}/{filt}"
            flat[f"eval/{task}/{name}"] = float(value)
    return flat
