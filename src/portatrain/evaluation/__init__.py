"""Evaluation with lm-evaluation-harness (PyPI ``lm-eval``): ``portatrain eval`` and ``trainer.eval_tasks``.

One module per concern:

- ``lm.py`` -- :class:`PortatrainLM`, portatrain's model as an lm-eval ``LM``: log-likelihoods,
  rolling log-likelihoods and greedy generation, scored as lm-eval's own Hugging Face model scores them;
- ``model.py`` -- the model it runs: a checkpoint's, built on the configured device and layout and
  loaded with its weights only (``portatrain eval``), or the Trainer's between steps;
- ``tasks.py`` -- lm-eval's tasks: local YAML task folders (``eval.include_path``) first, the task
  name check, running them, and their metrics as ``eval/<task>/<metric>``.

lm-eval is an optional dependency (``pip install 'portatrain[eval]'``), imported only when tasks run.
"""

from __future__ import annotations

from portatrain.evaluation.tasks import (
    eval_problems,
    flat_metrics,
    run_tasks,
    task_manager,
    task_names,
    task_problems,
)

__all__ = ["eval_problems", "flat_metrics", "run_tasks", "task_manager", "task_names", "task_problems"]
