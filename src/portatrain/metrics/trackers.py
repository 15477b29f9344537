"""Experiment trackers, opt-in: ``WandbSink`` (``metrics.wandb=true``) and ``MLflowSink`` (``metrics.mlflow=URI``).

W&B runs offline into ``<run_dir>/wandb`` unless ``WANDB_MODE`` says otherwise. Both log the same
scalars as TensorBoard, under the same names, and the run's config redacted (``portatrain.redact``;
the command line W&B records too); their run ids are kept in ``<run_dir>/trackers.json`` so that a
resumed run continues the same tracker run (``start_trackers``). A tracker that fails --
unreachable, refused, gone mid-run -- costs one warning and is dropped (``_Tracker``); it never
stops training. ``metrics_problems`` checks the settings before anything runs.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import socket
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from portatrain.config import MetricsConfig
from portatrain.errors import ConfigError
from portatrain.metrics.sinks import scalars
from portatrain.redact import redact, redact_text

logger = logging.getLogger(__name__)

TRACKERS_FILE = "trackers.json"
"""In the run directory: each tracker's run id (and MLflow's URI), read back by a resumed run."""

_URI = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
"""A URI as MLflow takes one: a scheme (``http``, ``file``, ``sqlite``, ``postgresql+psycopg2``, a
plugin's) and ``://``; Databricks' ``databricks`` profile shorthand is the one scheme-less form."""

_MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""MLflow retries a failed request 7 times with exponential backoff, about 4 minutes
(https://mlflow.org/docs/latest/python_api/mlflow.environment_variables.html): one unreachable
server would stall training that long at every log. These bound it to seconds; a value the user set
in the environment wins."""


def _connect_or_raise(uri: str, timeout_s: float = 10.0) -> None:
    """Open (and close) a TCP connection to an ``http(s)`` tracking server: a server that is not
    there fails here at once, in one line, rather than through MLflow's retries (each a urllib3
    warning). Skipped where a proxy carries the request (the proxy may reach what this host cannot)."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    if urllib.request.getproxies().get(parts.scheme) and not urllib.request.proxy_bypass(parts.hostname):
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    socket.create_connection((parts.hostname, port), timeout=timeout_s).close()


def mlflow_uri_problem(uri: str) -> str | None:
    """Why ``metrics.mlflow=uri`` is not a tracking URI MLflow can use, or None."""
    parts = urlsplit(uri)
    ok = uri == "databricks" or bool(_URI.fullmatch(uri))
    if ok and parts.scheme in ("http", "https"):
        try:
            ok = bool(parts.hostname) and parts.port != 0
        except ValueError:  # a port that is not a number in 0-65535
            ok = False
    if (
        ok
        and parts.scheme == "file"
        and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1")
    ):
        # MLflow 3's file store is in maintenance mode: it raises on every new client unless
        # MLFLOW_ALLOW_FILE_STORE opts back in (mlflow/store/tracking/file_store.py), so the run would
        # log nothing past one warning. https://mlflow.org/docs/latest/self-hosting/migrate-from-file-store
        return (
            f"metrics.mlflow={redact_text(uri)!r}: MLflow's file store is in maintenance mode and refuses "
            "new runs; use a local database, metrics.mlflow=sqlite:///ABS/mlflow.db, or a tracking server, "
            "http://HOST:PORT (or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store)"
        )
    if ok:
        return None
    return (
        f"metrics.mlflow={redact_text(uri)!r} is not a tracking URI; write it with its scheme: "
        "http://HOST:PORT for a tracking server, sqlite:///ABS/mlflow.db for a local store (or "
        "metrics.mlflow=null for none)"
    )


def metrics_problems(cfg: MetricsConfig) -> list[str]:
    """The metrics section's problems: a tracker URI that is not a URI, a tracker not installed."""
    problems = []
    if cfg.mlflow is not None:
        problem = mlflow_uri_problem(cfg.mlflow)
        problems += [problem] if problem else []
    for package, wanted in (("wandb", cfg.wandb), ("mlflow", cfg.mlflow is not None)):
        if wanted and importlib.util.find_spec(package) is None:
            problems.append(_missing_package(package))
    return problems


def _missing_package(package: str) -> str:
    off = "false" if package == "wandb" else "null"
    return (
        f"metrics.{package} needs the {package} package; pip install 'portatrain[{package}]' or set "
        f"metrics.{package}={off}"
    )


def _import_tracker(package: str) -> Any:
    """Import ``wandb`` / ``mlflow`` only when its sink is enabled (``import portatrain`` never does)."""
    try:
        return __import__(package)
    except ImportError as exc:
        raise ConfigError(f"{_missing_package(package)} ({exc})") from exc


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}``: MLflow's params are flat strings."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return flat


@contextmanager
def _redacted_argv() -> Iterator[None]:
    """``sys.argv`` with its credentials redacted (``portatrain.redact.redact_text``) while W&B starts.

    W&B records the command line in the run's metadata (``Settings._args`` is ``sys.argv[1:]``, read
    when ``wandb.init`` hands its settings to the service: wandb/sdk/wandb_settings.py), and the command
    line is where secrets arrive (``+launch.env.HF_TOKEN=...``). The rest of the metadata is
    worth keeping, so W&B sees the arguments as the config shows them, not no arguments."""
    argv = list(sys.argv)
    sys.argv[1:] = [redact_text(arg) for arg in argv[1:]]
    try:
        yield
    finally:
        sys.argv[:] = argv


class WandbSink:
    """Weights & Biases: scalars at the trainer's step, the redacted config as the run's config.

    Offline by default (``wandb.init(mode="offline")``): the run is written under
    ``<run_dir>/wandb/offline-run-*`` and uploaded later with ``wandb sync``, so training never
    waits on the network or needs an API key; ``WANDB_MODE=online`` streams instead. ``run_id`` (from
    :data:`TRACKERS_FILE`) continues a run with ``resume="allow"``: a resumed training run writes a
    second offline directory with the same id, and ``wandb sync`` uploads both, in order, into one run
    (https://docs.wandb.ai/guides/runs/resuming).
    """

    name = "wandb"

    def __init__(self, run_dir: Path, *, run_id: str | None, run_name: str, config: dict[str, Any]) -> None:
        wandb = _import_tracker("wandb")
        with _redacted_argv():
            self._run = wandb.init(
                dir=str(run_dir),
                mode=os.environ.get("WANDB_MODE") or "offline",
                project=os.environ.get("WANDB_PROJECT") or "portatrain",
                id=run_id,
                resume="allow",
                name=run_name,
                config=config,
            )
        self.run_id = self._run.id
        self.where = str(Path(self._run.dir).parent)  # offline-run-*/ (run.dir is its files/)

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self._run.log(values, step=record.get("step"))

    def close(self) -> None:
        self._run.finish()


class MLflowSink:
    """MLflow, through ``MlflowClient`` on ``uri``: scalars as metrics at the trainer's step, the
    redacted config as params (dotted keys; MLflow keeps a run's first value of a param, so a resume
    logs only keys the run does not have yet). Experiment ``MLFLOW_EXPERIMENT_NAME``, else
    ``portatrain``. ``run_id`` (from :data:`TRACKERS_FILE`) continues that run."""

    name = "mlflow"

    def __init__(self, uri: str, *, run_id: str | None, run_name: str, config: dict[str, Any]) -> None:
        _import_tracker("mlflow")
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param, RunStatus

        for var, value in _MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(var, value)
        _connect_or_raise(uri)
        self._metric, self._finished = Metric, RunStatus.to_string(RunStatus.FINISHED)
        self._client = MlflowClient(tracking_uri=uri)
        self.where = redact_text(uri)
        if run_id is not None:
            self._client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            logged = self._client.get_run(run_id).data.params
        else:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "portatrain"
            experiment = self._client.get_experiment_by_name(experiment_name)
            experiment_id = (
                experiment.experiment_id if experiment else self._client.create_experiment(experiment_name)
            )
            run_id, logged = self._client.create_run(experiment_id, run_name=run_name).info.run_id, {}
        self.run_id = run_id
        params = [Param(k, v) for k, v in _flatten(config).items() if k not in logged]
        if params:
            self._client.log_batch(run_id, params=params)

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            now_ms, step = int(time.time() * 1000), int(record.get("step") or 0)
            metrics = [self._metric(k, float(v), now_ms, step) for k, v in values.items()]
            self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id, status=self._finished)


class _Tracker:
    """A tracker sink whose failures are one warning: the first exception it raises (at start, in a
    log or at close) is logged and the tracker is dropped for the rest of the run. Trackers are
    network services and third-party code; no failure of theirs may cost the training run."""

    def __init__(self, name: str, start: Callable[[], Any]) -> None:
        self.name, self.sink = name, None
        try:
            self.sink = start()
        except ConfigError:
            raise  # not installed: the user's to fix before the run (metrics_problems says so first)
        except Exception as exc:
            self._drop("could not start", exc)

    def log(self, record: dict[str, Any]) -> None:
        if self.sink is not None:
            try:
                self.sink.log(record)
            except Exception as exc:
                self._drop(f"failed at step {record.get('step')}", exc)

    def close(self) -> None:
        if self.sink is not None:
            try:
                self.sink.close()
            except Exception as exc:
                self._drop("failed to close its run", exc)

    def _drop(self, what: str, exc: Exception) -> None:
        self.sink = None
        message = redact_text(f"{type(exc).__name__}: {exc}".splitlines()[0])
        message = message if len(message) <= 300 else message[:297] + "..."
        logger.warning("%s %s (%s); training goes on without it", self.name, what, message)


def start_trackers(
    run_dir: Path, *, wandb: bool, mlflow: str | None, config: Any, resumed: bool
) -> list[_Tracker]:
    """Start the enabled trackers, continuing the runs :data:`TRACKERS_FILE` names when ``resumed``
    (MLflow's only on the same URI), and write the file with the runs in use."""
    path = run_dir / TRACKERS_FILE
    previous = json.loads(path.read_text()) if resumed and path.is_file() else {}
    config = redact(config) if config is not None else {}
    # W&B's run name and MLflow's mlflow.runName tag: the run directory's name could hold a secret too.
    run_name = redact_text(f"{config.get('recipe', 'portatrain')}/{run_dir.name}")
    trackers, ids = [], {}
    if wandb:
        wandb_id = previous.get("wandb", {}).get("run_id")
        trackers.append(
            _Tracker("W&B", lambda: WandbSink(run_dir, run_id=wandb_id, run_name=run_name, config=config))
        )
    if mlflow is not None:
        same_uri = previous.get("mlflow", {}).get("uri") == redact_text(mlflow)
        mlflow_id = previous["mlflow"].get("run_id") if same_uri else None
        trackers.append(
            _Tracker(
                f"MLflow at {redact_text(mlflow)}",
                lambda: MLflowSink(mlflow, run_id=mlflow_id, run_name=run_name, config=config),
            )
        )
    for tracker in trackers:
        if tracker.sink is not None:
            ids[tracker.sink.name] = {"run_id": tracker.sink.run_id}
            logger.info("%s run %s: %s", tracker.name, tracker.sink.run_id, tracker.sink.where)
    if "mlflow" in ids:
        ids["mlflow"]["uri"] = redact_text(mlflow)
    path.write_text(json.dumps({**previous, **ids}, indent=1) + "\n")
    return trackers
