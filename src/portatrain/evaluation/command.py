"""``portatrain eval``: load a checkpoint's model on the configured device and layout, run lm-eval
tasks on it, print lm-eval's table (rank 0) and write its results to ``eval.out`` when set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from portatrain.config import Config
from portatrain.errors import ConfigError
from portatrain.evaluation.tasks import run_tasks, task_names


def eval_command(cfg: Config) -> dict[str, Any] | None:
    """Evaluate ``eval.checkpoint`` on ``eval.tasks``; lm-eval's results (None on ranks other than 0)."""
    from lm_eval.utils import handle_non_serializable, make_table

    from portatrain.checkpoint import find_checkpoint
    from portatrain.distributed import dist_info_from_env
    from portatrain.evaluation.model import eval_mode, harness_lm, load_checkpoint_model

    names = task_names(cfg.eval.tasks)
    if not names:
        raise ConfigError(
            "eval.tasks is empty: name the lm-eval tasks to run, e.g. portatrain eval checkpoint=PATH "
            "tasks=[hellaswag,arc_easy] (local ones with eval.include_path=[DIR])"
        )
    checkpoint = find_checkpoint(cfg.eval.checkpoint, Path(cfg.run_dir))
    loaded = load_checkpoint_model(cfg, checkpoint)
    lm = harness_lm(
        loaded.model,
        loaded.tokenizer,
        cfg.eval,
        device=loaded.accelerator.device,
        dtype=loaded.dtype,
        tp=loaded.tp,
    )
    with eval_mode(loaded.model):
        results = run_tasks(lm, names, cfg.eval)
    if dist_info_from_env().is_main and results is not None:
        print(f"{checkpoint} (step {loaded.step}):")
        print(make_table(results))
        if "groups" in results:
            print(make_table(results, "groups"))
        if cfg.eval.out:
            out = Path(cfg.eval.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            record = {"checkpoint": str(checkpoint), "step": loaded.step, **results}
            out.write_text(json.dumps(record, indent=2, default=handle_non_serializable) + "\n")
            print(f"results written to {out}")
    return results
